"""Train-and-evaluate jobs, and the sweep that runs many of them in parallel processes.

One *job* trains a scheme with one seed (or loads its checkpoint) and runs every evaluation
of :mod:`companion.lab.evaluate`; a *sweep* runs the jobs of several schemes and seeds in a
pool of worker processes, one torch thread each (on a 2-core machine, two single-threaded
processes beat one two-threaded one: small kernels stall on OpenMP barriers), and writes one
JSON file with provenance.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..utils import provenance, save_result
from .corpus import Corpus, load_corpus
from .._checks import check_positive_int
from .data import KEY_LEN, QUERY_LEN
from .evaluate import (BLOCKS, SLIDING_TOKENS, WINDOWS, _check_blocks, _check_depths, attention_entropy,
                       bits_per_byte, passkey_retrieval, sliding_bits_per_byte)
from .train import TrainConfig, train

__all__ = ["EvalConfig", "check_eval_config", "check_protocol", "evaluate_model", "checkpoint_path", "run_job",
           "run_sweep"]


@dataclass
class EvalConfig:
    """Which evaluations a job runs, at which lengths (multiples of the training length), on
    how much text. The defaults are the book's protocol: ``windows * TAIL = 2**17`` tail bytes
    and ``sliding_tokens = 2**17`` sliding bytes per length, ``blocks`` bootstrap units per
    metric, and 32 passkey trials per (length, depth) cell.

    Every field is checked where the config is made (:func:`check_eval_config` without a
    training config): ``multiples`` and ``passkey_multiples`` non-empty lists of ints >= 1,
    the counts ints >= 1 with ``blocks`` dividing ``windows`` and at most ``sliding_tokens``,
    ``passkey_depths`` a non-empty list of numbers in ``[0, 1]``.

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """

    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    windows: int = WINDOWS
    blocks: int = BLOCKS
    sliding_tokens: int = SLIDING_TOKENS
    passkey_multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    passkey_trials: int = 32
    entropy_windows: int = 8

    def __post_init__(self) -> None:
        _check_fields(self)


def _int_list(values: object, name: str, minimum: int = 1) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a non-empty list of ints, got {type(values).__name__} {values!r}")
    if not values:
        raise ValueError(f"{name} must be a non-empty list of ints, got {values!r}")
    return [check_positive_int(v, name, minimum) for v in values]


def check_protocol(ev: Any) -> None:
    """Check the fields an :class:`EvalConfig` and an
    :class:`~companion.lab.extend.ExtendConfig` share, without a model or data, as the
    evaluations would (so that a command line can refuse them before training).

    ``multiples``: a non-empty list of ints >= 1; ``windows``, ``blocks``, ``sliding_tokens``,
    ``passkey_trials``, ``entropy_windows``: ints >= 1, with ``blocks`` dividing ``windows``
    and at most ``sliding_tokens`` (one byte per stretch); ``passkey_depths``: a non-empty
    list of numbers in ``[0, 1]``.

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """
    _int_list(ev.multiples, "multiples")
    for name in ("windows", "blocks", "sliding_tokens", "passkey_trials", "entropy_windows"):
        check_positive_int(getattr(ev, name), name)
    _check_blocks(ev.blocks, ev.windows, "windows")
    if ev.sliding_tokens < ev.blocks:
        raise ValueError(f"sliding_tokens ({ev.sliding_tokens}) must be at least blocks ({ev.blocks}): "
                         f"each of the blocks scores sliding_tokens // blocks bytes")
    depths = ev.passkey_depths
    if not isinstance(depths, (list, tuple)):
        raise TypeError(f"passkey_depths must be a non-empty list of numbers in [0, 1], got "
                        f"{type(depths).__name__} {depths!r}")
    _check_depths(depths, "passkey_depths")


def _check_fields(ev: EvalConfig) -> None:
    """The checks of an :class:`EvalConfig` that need no training config."""
    check_protocol(ev)
    _int_list(ev.passkey_multiples, "passkey_multiples")


def _check_reach(cfg: TrainConfig, ev: EvalConfig) -> None:
    longest = max(m * cfg.seq_len for m in [*ev.multiples, *ev.passkey_multiples])
    if longest > cfg.max_len:
        raise ValueError(
            f"the evaluation reaches length {longest}, past the config's max_len = {cfg.max_len} "
            f"(the longest sequence the model was built for); raise max_len or lower the multiples"
        )


def check_eval_config(ev: EvalConfig, cfg: TrainConfig | None = None) -> EvalConfig:
    """Check ``ev`` without a model or data (:func:`check_protocol`, and ``passkey_multiples``
    a non-empty list of ints >= 1); with the training config ``cfg``, also that every length
    fits its ``max_len`` (as :func:`evaluate_model` requires) and that each passkey length
    holds a key and a query. Returns ``ev``.

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """
    if not isinstance(ev, EvalConfig):
        raise TypeError(f"ev must be an EvalConfig, got {type(ev).__name__}")
    _check_fields(ev)  # again: a field may have been changed since the config was made
    if cfg is not None:
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"cfg must be a TrainConfig or None, got {type(cfg).__name__}")
        _check_reach(cfg, ev)
        shortest = min(ev.passkey_multiples) * cfg.seq_len
        if shortest < KEY_LEN + QUERY_LEN:
            raise ValueError(f"passkey_multiples: the passkey length {shortest} (min(passkey_multiples) * seq_len) "
                             f"must be at least {KEY_LEN + QUERY_LEN}, a key and a query")
    return ev


def _rounded(values: list[float]) -> list[float]:
    """Per-block means as stored: 4 decimals of bits (far below any difference a claim uses)."""
    return [round(v, 4) for v in values]


def evaluate_model(model: torch.nn.Module, cfg: TrainConfig, ev: EvalConfig,
                   corpus: Corpus | None = None) -> dict[str, Any]:
    """Every evaluation of a trained model: ``{"eval": {...}, "eval_seconds": s}``.

    ``eval`` holds ``lengths``; ``bpb`` (``{W: {"all", "tail"}}``) and ``sliding_bpb``
    (``{W: bits}``), the means; ``blocks`` (``{"all" | "tail" | "sliding": {W: [...]}}``),
    the same metrics per bootstrap unit; ``passkey`` (the cells of
    :func:`~companion.lab.evaluate.passkey_retrieval`, with every trial); and ``entropy``.

    Raises:
        TypeError, ValueError: ``cfg`` or ``ev`` not a config, or ``ev`` invalid for
            ``cfg`` (:func:`check_eval_config`), checked before the corpus is loaded.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    check_eval_config(ev, cfg)
    corpus = load_corpus() if corpus is None else corpus
    t0 = time.perf_counter()
    lengths = [m * cfg.seq_len for m in ev.multiples]
    pk_lengths = [m * cfg.seq_len for m in ev.passkey_multiples]
    val = corpus.val
    bpb = bits_per_byte(model, val, lengths, windows_per_length=ev.windows, blocks=ev.blocks)
    sliding = sliding_bits_per_byte(model, val, lengths, scored_tokens=ev.sliding_tokens, blocks=ev.blocks)
    passkey = passkey_retrieval(model, val, pk_lengths, ev.passkey_depths, trials=ev.passkey_trials, seed=cfg.seed)
    passkey["gain_trials"] = [[_rounded(cell) for cell in row] for row in passkey["gain_trials"]]
    result = {
        "lengths": lengths,
        "bpb": {str(w): {"all": v["all"], "tail": v["tail"]} for w, v in bpb.items()},
        "sliding_bpb": {str(w): v["sliding"] for w, v in sliding.items()},
        "blocks": {
            "all": {str(w): _rounded(v["all_blocks"]) for w, v in bpb.items()},
            "tail": {str(w): _rounded(v["tail_blocks"]) for w, v in bpb.items()},
            "sliding": {str(w): _rounded(v["sliding_blocks"]) for w, v in sliding.items()},
        },
        "passkey": {"lengths": pk_lengths, "depths": list(ev.passkey_depths), **passkey},
        "entropy": {str(k): v for k, v in
                    attention_entropy(model, val, lengths, windows_per_length=ev.entropy_windows).items()},
    }
    return {"eval": result, "eval_seconds": time.perf_counter() - t0}


def checkpoint_path(checkpoint_dir: str | os.PathLike[str], cfg: TrainConfig) -> Path:
    """Where a sweep keeps the checkpoint of a config."""
    safe = cfg.scheme.replace(":", "-").replace("/", "-")
    return Path(checkpoint_dir) / f"{safe}-L{cfg.seq_len}-d{cfg.d_model}-n{cfg.steps}-s{cfg.seed}.pt"


def _eval_cache(ckpt: Path, ev: EvalConfig) -> Path:
    key = hashlib.sha256(json.dumps(asdict(ev), sort_keys=True).encode()).hexdigest()[:12]
    return ckpt.with_name(f"{ckpt.stem}.eval-{key}.json")


def run_job(cfg: TrainConfig, ev: EvalConfig, checkpoint_dir: str | None, progress: bool = False) -> dict[str, Any]:
    """Train (or resume from ``checkpoint_dir``) and evaluate one scheme and seed.

    With a ``checkpoint_dir`` the record is also kept beside the checkpoint, keyed by the
    evaluation config, so a sweep that is run again (or resumed after an interruption) reuses
    every finished job instead of evaluating it again.
    """
    corpus = load_corpus()
    ckpt = None if checkpoint_dir is None else checkpoint_path(checkpoint_dir, cfg)
    cache = None if ckpt is None else _eval_cache(ckpt, ev)
    if cache is not None and cache.exists() and ckpt is not None and ckpt.exists():
        record = json.loads(cache.read_text())
        if record.get("config") == asdict(cfg) and record.get("eval_config") == asdict(ev):
            del record["eval_config"]
            return record
    model, record = train(cfg, corpus, checkpoint=ckpt, progress=progress)
    record.update(evaluate_model(model, cfg, ev, corpus))
    del record["provenance"]  # the sweep stores one provenance for all jobs
    if cache is not None:
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "eval_config": asdict(ev)}))
        os.replace(tmp, cache)
    return record


def _worker(args: tuple[dict, dict, str | None]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg, ev, ckpt_dir = args
    return run_job(TrainConfig(**cfg), EvalConfig(**ev), ckpt_dir)


def run_sweep(
    configs: list[TrainConfig],
    ev: EvalConfig,
    *,
    out: str | os.PathLike[str] | None,
    workers: int = 2,
    checkpoint_dir: str | None = None,
    command: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run every config's job in ``workers`` processes; save and return the result.

    The result has ``runs`` (one record per config, in order), ``eval_config``,
    ``wall_seconds``, ``workers`` and ``corpus``; with ``out`` it is saved with
    :func:`~companion.utils.save_result` (provenance included), otherwise its provenance is
    added under ``"provenance"``. ``verbose`` prints a line as each job finishes.
    """
    t0 = time.perf_counter()
    jobs = [(asdict(c), asdict(ev), checkpoint_dir) for c in configs]
    if workers <= 1:
        runs = [_worker(j) for j in jobs]
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            runs = []
            for i, r in enumerate(pool.imap(_worker, jobs)):
                runs.append(r)
                if verbose:
                    print(f"[{i + 1}/{len(jobs)}] {r['config']['scheme']} seed {r['config']['seed']}: "
                          f"train {r['seconds']:.0f} s, eval {r['eval_seconds']:.0f} s", flush=True)
    result = {
        "eval_config": asdict(ev),
        "runs": runs,
        "wall_seconds": time.perf_counter() - t0,
        "workers": workers,
        "corpus": load_corpus().info,
    }
    if out is not None:
        save_result(out, result, command=command)
    else:
        result["provenance"] = provenance(command)
    return result
