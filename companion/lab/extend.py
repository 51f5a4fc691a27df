"""Context extension in the lab: a trained RoPE model, each scaling method, with and without fine-tuning.

A *method* maps a scale ``s`` and the training length ``L`` to a HuggingFace-style RoPE
config (:mod:`companion.scaling`), which :func:`apply_method` installs in the model's
:class:`~companion.rope.RotaryEmbedding` (shared by every layer). An *extension job* takes one
trained checkpoint, one method and one scale, optionally fine-tunes the model for a few
hundred steps at ``s L`` with the method in place, and runs the evaluations of
:mod:`companion.lab.evaluate` at every length. :func:`run_extension` runs many jobs in worker
processes and returns flat rows that :func:`companion.utils.save_csv` writes with provenance.

LongRoPE's per-pair factors are not a formula but the result of a search. :func:`longrope_search`
is a small evolutionary search in the spirit of the paper's (:cite:`ding2024longrope`): it
starts from the PI, NTK and YaRN factors, mutates them multiplicatively, keeps them
non-decreasing from high to low frequency and within ``[1, 2 s]``, and selects by bits per
byte at ``s L`` on windows of the *training* split (the validation split stays unseen).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..model import TinyDecoder
from ..rope import RotaryEmbedding, rope_frequencies
from ..scaling import compute_inv_freq
from .corpus import Corpus, load_corpus
from .data import sample_batch, windows
from .evaluate import attention_entropy, bits_per_byte, evenly_spaced_starts, passkey_retrieval, sliding_bits_per_byte
from .train import TrainConfig, _optimizer, load_checkpoint, train

__all__ = ["METHODS", "METHOD_LABELS", "method_config", "apply_method", "finetune", "longrope_search",
           "ExtendConfig", "extension_job", "run_extension", "train_missing", "CSV_FIELDS"]

BASE = 10000.0  # the lab's RoPE base (RotaryEmbedding's default)


def _yarn(s: float, L: int, base: float) -> dict[str, Any]:
    return {"rope_type": "yarn", "rope_theta": base, "factor": s, "original_max_position_embeddings": L}


#: method name -> (scale, training length, base, head_dim) -> rope config. ``longrope`` needs
#: searched factors, so its config comes from :func:`longrope_search` instead.
METHODS: dict[str, Callable[..., dict[str, Any]]] = {
    "none": lambda s, L, base, d: {"rope_type": "default", "rope_theta": base},
    "pi": lambda s, L, base, d: {"rope_type": "linear", "rope_theta": base, "factor": s},
    "ntk": lambda s, L, base, d: {"rope_type": "ntk", "rope_theta": base, "factor": s},
    "dynamic": lambda s, L, base, d: {"rope_type": "dynamic", "rope_theta": base, "factor": s},
    "yarn": lambda s, L, base, d: _yarn(s, L, base),
    # YaRN's frequencies without its temperature: isolates what the attention factor does
    "yarn-no-temp": lambda s, L, base, d: {**_yarn(s, L, base), "attention_factor": 1.0},
    "llama3": lambda s, L, base, d: {"rope_type": "llama3", "rope_theta": base, "factor": s, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": L},
    "longrope": lambda s, L, base, d: {"rope_type": "longrope", "rope_theta": base, "factor": s,
                                       "original_max_position_embeddings": L,
                                       "short_factor": [1.0] * (d // 2), "long_factor": [float(s)] * (d // 2)},
}

METHOD_LABELS = {"none": "no scaling", "pi": "PI (linear)", "ntk": "NTK-aware", "dynamic": "Dynamic NTK",
                 "yarn": "YaRN", "yarn-no-temp": "YaRN, no temperature", "llama3": "Llama 3",
                 "longrope": "LongRoPE"}

CSV_FIELDS = ["seed", "method", "factor", "finetune_steps", "metric", "length", "where", "value"]


def method_config(method: str, factor: float, train_len: int, head_dim: int, base: float = BASE,
                  long_factor: Sequence[float] | None = None) -> dict[str, Any]:
    """The rope config of ``method`` at scale ``factor`` for a model trained at ``train_len``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    cfg = METHODS[method](float(factor), int(train_len), float(base), int(head_dim))
    if method == "longrope" and long_factor is not None:
        cfg["long_factor"] = [float(x) for x in long_factor]
    return cfg


def _rope_scheme(model: TinyDecoder) -> RotaryEmbedding:
    scheme = model.scheme
    if not isinstance(scheme, RotaryEmbedding):
        raise ValueError(f"context extension needs a RoPE model, got scheme {type(scheme).__name__}")
    return scheme


def apply_method(model: TinyDecoder, rope_config: dict[str, Any], train_len: int) -> None:
    """Install ``rope_config`` in the model's shared :class:`RotaryEmbedding` (in place)."""
    _rope_scheme(model).set_rope_config(rope_config, max_position_embeddings=train_len)


def finetune(model: TinyDecoder, cfg: TrainConfig, corpus: Corpus, *, seq_len: int, steps: int,
             lr: float = 1e-3, warmup: int = 20, seed: int = 0) -> list[dict[str, float]]:
    """Continue training at ``seq_len`` for ``steps`` steps (AdamW, warmup then constant ``lr``).

    The batch holds ``cfg.batch_size * cfg.seq_len // seq_len`` windows (at least 1), so a step
    sees as many tokens as a pretraining step; the data mix (retrieval rows included) is the
    pretraining one. Returns the loss log (bits per byte every 10 steps). The model stays in
    place and ends in eval mode.
    """
    batch = max(1, cfg.batch_size * cfg.seq_len // seq_len)
    opt = _optimizer(model, cfg)
    gen = torch.Generator().manual_seed(10_000 + seed)
    log = []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup))
        x, y = sample_batch(corpus.train, batch, seq_len, gen, retrieval_fraction=cfg.retrieval_fraction,
                            retrieval_queries=cfg.retrieval_queries)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if (step + 1) % 10 == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": float(loss.detach()) / math.log(2)})
    model.eval()
    return log


@torch.no_grad()
def _train_bpb(model: TinyDecoder, rows: torch.Tensor) -> float:
    logits = model(rows[:, :-1]).float()
    return float(F.cross_entropy(logits.transpose(1, 2), rows[:, 1:]) / math.log(2))


def longrope_search(model: TinyDecoder, corpus: Corpus, factor: float, train_len: int, *, generations: int = 8,
                    population: int = 12, windows_count: int = 6, seed: int = 0) -> dict[str, Any]:
    """Search LongRoPE long factors for scale ``factor`` (see the module doc).

    Candidates are scored by bits per byte on ``windows_count`` windows of ``factor *
    train_len`` bytes of the training split. Each generation keeps the best quarter and fills
    the population with mutants of it (multiplicative log-normal noise of 0.15, one in three
    pairs, then the constraints) and crossovers of two parents. Returns the best factors, their
    score, the starting points' scores and the best score of each generation.
    """
    scheme = _rope_scheme(model)
    d = scheme.rotary_dim
    h = d // 2
    n = int(round(factor * train_len))
    rng = np.random.default_rng(seed)
    rows = windows(corpus.train, evenly_spaced_starts(corpus.train.size, n + 1, windows_count), n + 1)
    plain = rope_frequencies(d, BASE).double()
    saved = (scheme.rope_spec, scheme.inv_freq, scheme.attention_scaling, scheme.base)

    def starts() -> dict[str, np.ndarray]:
        out = {}
        for name in ("pi", "ntk", "yarn"):
            inv, _ = compute_inv_freq(method_config(name, factor, train_len, d), d,
                                      max_position_embeddings=train_len)
            out[name] = (plain / inv.double()).numpy()
        return out

    def legal(f: np.ndarray) -> np.ndarray:
        f = np.clip(f, 1.0, 2.0 * factor)
        return np.maximum.accumulate(f)  # non-decreasing towards the low frequencies

    def score(f: np.ndarray) -> float:
        cfg = method_config("longrope", factor, train_len, d, long_factor=f.tolist())
        apply_method(model, cfg, train_len)
        return _train_bpb(model, rows)

    seeds = starts()
    pool = [(score(legal(f)), legal(f)) for f in seeds.values()]
    seed_scores = {k: s for k, (s, _) in zip(seeds, pool)}
    while len(pool) < population:
        parent = pool[rng.integers(len(seeds))][1]
        child = legal(parent * np.exp(rng.normal(0, 0.15, h) * (rng.random(h) < 1 / 3)))
        pool.append((score(child), child))
    history = [min(s for s, _ in pool)]
    for _ in range(generations):
        pool.sort(key=lambda t: t[0])
        elite = pool[: max(2, population // 4)]
        children = []
        while len(elite) + len(children) < population:
            if rng.random() < 0.3:
                a, b = (elite[i][1] for i in rng.choice(len(elite), 2, replace=False))
                child = legal(np.where(rng.random(h) < 0.5, a, b))
            else:
                parent = elite[rng.integers(len(elite))][1]
                child = legal(parent * np.exp(rng.normal(0, 0.15, h) * (rng.random(h) < 1 / 3)))
            children.append((score(child), child))
        pool = elite + children
        history.append(min(s for s, _ in pool))
    best_score, best = min(pool, key=lambda t: t[0])
    spec, inv_freq, attention_scaling, base = saved  # leave the model as it was
    if spec is not None:
        scheme.set_rope_config(spec.params, max_position_embeddings=spec.max_position_embeddings)
    else:
        scheme.rope_spec = None
        scheme.set_frequencies(inv_freq, attention_scaling)
        scheme.base = base
    return {"long_factor": best.tolist(), "score": best_score, "start_scores": seed_scores, "history": history,
            "evaluations": population + generations * (population - max(2, population // 4))}


@dataclass
class ExtendConfig:
    """What an extension sweep measures (lengths are multiples of the training length)."""

    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    tokens: int = 1 << 14
    sliding_tokens: int = 1 << 12
    passkey_multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    passkey_trials: int = 8
    entropy_windows: int = 2
    finetune_lr: float = 1e-3


def _evaluate(model: TinyDecoder, cfg: TrainConfig, ev: ExtendConfig, corpus: Corpus,
              reset: Callable[[], None]) -> list[tuple[str, int, str, float]]:
    """``(metric, length, where, value)`` rows. ``reset`` restores the scheme's state before
    each evaluation (Dynamic NTK only grows its base within one pass over the lengths)."""
    L = cfg.seq_len
    lengths = [m * L for m in ev.multiples]
    pk = [m * L for m in ev.passkey_multiples]
    val = corpus.val
    out = []
    reset()
    for w, v in bits_per_byte(model, val, lengths, tokens=ev.tokens).items():
        out += [("bpb_all", w, "", v["all"]), ("bpb_tail", w, "", v["tail"])]
    reset()
    for w, v in sliding_bits_per_byte(model, val, lengths, scored_tokens=ev.sliding_tokens).items():
        out.append(("sliding_bpb", w, "", v))
    reset()
    res = passkey_retrieval(model, val, pk, ev.passkey_depths, trials=ev.passkey_trials, seed=cfg.seed)
    for i, w in enumerate(pk):
        for j, depth in enumerate(ev.passkey_depths):
            out += [("passkey_gain", w, f"{depth:g}", res["gain"][i][j]),
                    ("passkey_exact", w, f"{depth:g}", res["exact"][i][j])]
    reset()
    for w, per_layer in attention_entropy(model, val, lengths, windows_per_length=ev.entropy_windows).items():
        out += [("entropy", w, f"layer{li}", e) for li, e in enumerate(per_layer)]
    return out


def extension_job(checkpoint: str, method: str, factor: float, finetune_steps: int, ev: ExtendConfig,
                  long_factor: Sequence[float] | None = None) -> dict[str, Any]:
    """Load ``checkpoint``, install ``method`` at ``factor``, fine-tune, evaluate."""
    t0 = time.perf_counter()
    model, ckpt = load_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(ckpt["config"])
    corpus = load_corpus()
    d = _rope_scheme(model).rotary_dim
    rope_cfg = method_config(method, factor, cfg.seq_len, d, long_factor=long_factor)
    apply_method(model, rope_cfg, cfg.seq_len)
    log: list[dict[str, float]] = []
    if finetune_steps:
        log = finetune(model, cfg, corpus, seq_len=int(round(factor * cfg.seq_len)), steps=finetune_steps,
                       lr=ev.finetune_lr, seed=cfg.seed)

    def reset() -> None:
        apply_method(model, rope_cfg, cfg.seq_len)

    rows = [{"seed": cfg.seed, "method": method, "factor": factor, "finetune_steps": finetune_steps,
             "metric": m, "length": w, "where": where, "value": f"{v:.6g}"}
            for m, w, where, v in _evaluate(model, cfg, ev, corpus, reset)]
    return {"rows": rows, "finetune_log": log, "rope_config": rope_cfg, "seconds": time.perf_counter() - t0}


def _train_base(args: tuple) -> str:
    torch.set_num_threads(1)
    cfg, path = args
    train(TrainConfig(**cfg), load_corpus(), checkpoint=path, progress=False)
    return path


def train_missing(configs: Sequence[TrainConfig], paths: Sequence[str], workers: int = 2) -> None:
    """Train (in ``workers`` processes) the configs whose checkpoint file does not exist yet."""
    todo = [(asdict(c), str(p)) for c, p in zip(configs, paths) if not Path(p).exists()]
    if not todo:
        return
    if workers <= 1 or len(todo) == 1:
        for job in todo:
            _train_base(job)
    else:
        with mp.get_context("spawn").Pool(min(workers, len(todo))) as pool:
            pool.map(_train_base, todo)


def _worker(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    kind = args[0]
    if kind == "search":
        _, checkpoint, factor, seed = args
        model, ckpt = load_checkpoint(checkpoint)
        cfg = TrainConfig.from_dict(ckpt["config"])
        res = longrope_search(model, load_corpus(), factor, cfg.seq_len, seed=seed)
        return {"kind": "search", "checkpoint": checkpoint, "factor": factor, **res}
    _, checkpoint, method, factor, steps, ev, long_factor = args
    return {"kind": "job", **extension_job(checkpoint, method, factor, steps, ExtendConfig(**ev), long_factor)}


def run_extension(checkpoints: Sequence[str], methods: Sequence[str], factors: Sequence[float],
                  finetune_steps: Sequence[int], ev: ExtendConfig, *, workers: int = 2,
                  verbose: bool = True) -> dict[str, Any]:
    """Every (checkpoint, method, factor, fine-tune steps) job; LongRoPE searches first.

    ``none`` without fine-tuning is run once per checkpoint (at factor 1); with fine-tuning it
    is the baseline that trains plain RoPE at ``s L``. Returns
    ``{"rows": [...], "searches": [...], "finetune_logs": [...], "wall_seconds": s}``.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {m!r}")
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")

    def run(jobs: list[tuple]) -> list[dict[str, Any]]:
        if workers <= 1:
            return [_worker(j) for j in jobs]
        with ctx.Pool(workers) as pool:
            out = []
            for i, r in enumerate(pool.imap(_worker, jobs)):
                out.append(r)
                if verbose:
                    what = (f"search s={r['factor']:g}" if r["kind"] == "search"
                            else f"{r['rope_config']['rope_type']} {r['rows'][0]['method']} s={r['rows'][0]['factor']:g}"
                                 f" ft={r['rows'][0]['finetune_steps']}: {r['seconds']:.0f} s")
                    print(f"[{i + 1}/{len(jobs)}] {what}", flush=True)
            return out

    searches: dict[tuple[str, float], list[float]] = {}
    search_records = []
    if "longrope" in methods:
        found = run([("search", c, float(f), i) for i, c in enumerate(checkpoints) for f in factors])
        for r in found:
            searches[(r["checkpoint"], r["factor"])] = r["long_factor"]
            search_records.append({k: v for k, v in r.items() if k != "kind"})
    jobs = []
    for c in checkpoints:
        for steps in finetune_steps:
            for m in methods:
                # unscaled RoPE without fine-tuning does not depend on the factor: run it once
                for f in ([1.0] if (m == "none" and steps == 0) else factors):
                    jobs.append(("job", c, m, float(f), steps, asdict(ev), searches.get((c, float(f)))))
    results = run(jobs)
    return {
        "rows": [row for r in results for row in r["rows"]],
        "searches": search_records,
        "finetune_logs": [{"method": r["rows"][0]["method"], "factor": r["rows"][0]["factor"],
                           "seed": r["rows"][0]["seed"], "log": r["finetune_log"]}
                          for r in results if r["finetune_log"]],
        "wall_seconds": time.perf_counter() - t0,
    }
