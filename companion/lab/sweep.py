"""Train-and-evaluate jobs, and the sweep that runs many of them in parallel processes.

One *job* trains a scheme with one seed (or loads its checkpoint) and runs every evaluation
of :mod:`companion.lab.evaluate`; a *sweep* runs the jobs of several schemes and seeds in a
pool of worker processes, one torch thread each (on a 2-core machine, two single-threaded
processes beat one two-threaded one: small kernels stall on OpenMP barriers), and writes one
JSON file with provenance.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..utils import provenance, save_result
from .corpus import Corpus, load_corpus
from .evaluate import attention_entropy, bits_per_byte, passkey_retrieval, sliding_bits_per_byte
from .train import TrainConfig, train

__all__ = ["EvalConfig", "evaluate_model", "checkpoint_path", "run_job", "run_sweep"]


@dataclass
class EvalConfig:
    """Which evaluations a job runs, at which lengths (multiples of the training length)."""

    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    tokens: int = 1 << 15
    sliding_tokens: int = 1 << 13
    passkey_multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    passkey_trials: int = 8
    entropy_windows: int = 4


def evaluate_model(model: torch.nn.Module, cfg: TrainConfig, ev: EvalConfig,
                   corpus: Corpus | None = None) -> dict[str, Any]:
    """Every evaluation of a trained model: ``{"eval": {...}, "eval_seconds": s}``."""
    corpus = load_corpus() if corpus is None else corpus
    t0 = time.perf_counter()
    lengths = [m * cfg.seq_len for m in ev.multiples]
    pk_lengths = [m * cfg.seq_len for m in ev.passkey_multiples]
    longest = max(lengths + pk_lengths)
    if longest > cfg.max_len:
        raise ValueError(
            f"the evaluation reaches length {longest}, past the config's max_len = {cfg.max_len} "
            f"(the longest sequence the model was built for); raise max_len or lower the multiples"
        )
    val = corpus.val
    result = {
        "lengths": lengths,
        "bpb": {str(k): v for k, v in bits_per_byte(model, val, lengths, tokens=ev.tokens).items()},
        "sliding_bpb": {str(k): v for k, v in
                        sliding_bits_per_byte(model, val, lengths, scored_tokens=ev.sliding_tokens).items()},
        "passkey": {"lengths": pk_lengths, "depths": list(ev.passkey_depths),
                    **passkey_retrieval(model, val, pk_lengths, ev.passkey_depths,
                                        trials=ev.passkey_trials, seed=cfg.seed)},
        "entropy": {str(k): v for k, v in
                    attention_entropy(model, val, lengths, windows_per_length=ev.entropy_windows).items()},
    }
    return {"eval": result, "eval_seconds": time.perf_counter() - t0}


def checkpoint_path(checkpoint_dir: str | os.PathLike[str], cfg: TrainConfig) -> Path:
    """Where a sweep keeps the checkpoint of a config."""
    safe = cfg.scheme.replace(":", "-").replace("/", "-")
    return Path(checkpoint_dir) / f"{safe}-L{cfg.seq_len}-d{cfg.d_model}-n{cfg.steps}-s{cfg.seed}.pt"


def run_job(cfg: TrainConfig, ev: EvalConfig, checkpoint_dir: str | None, progress: bool = False) -> dict[str, Any]:
    """Train (or resume from ``checkpoint_dir``) and evaluate one scheme and seed."""
    corpus = load_corpus()
    ckpt = None if checkpoint_dir is None else checkpoint_path(checkpoint_dir, cfg)
    model, record = train(cfg, corpus, checkpoint=ckpt, progress=progress)
    record.update(evaluate_model(model, cfg, ev, corpus))
    del record["provenance"]  # the sweep stores one provenance for all jobs
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
