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

import hashlib
import json
import math
import multiprocessing as mp
import os
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
from .._checks import check_finite_number, check_positive_int
from .evaluate import (BLOCKS, SLIDING_TOKENS, WINDOWS, attention_entropy, bits_per_byte, evenly_spaced_starts,
                       passkey_retrieval, sliding_bits_per_byte)
from .sweep import _int_list, _rounded, check_protocol
from .train import TrainConfig, _optimizer, load_checkpoint, train

__all__ = ["METHODS", "METHOD_LABELS", "method_config", "apply_method", "finetune", "finetune_fraction",
           "longrope_search", "ExtendConfig", "check_extend_config", "job_lengths", "extension_job", "plan_jobs", "run_extension", "train_missing",
           "CSV_FIELDS"]

BASE = 10000.0  # the lab's RoPE base (RotaryEmbedding's default)


def _abf_base(s: float, L: int, base: float, d: int) -> float:
    from ..recipe import abf_base
    return abf_base(int(math.ceil(s * L)), d, base)


def _trained_base(model: TinyDecoder) -> float:
    """The base of a freshly loaded RoPE model (``rope-b<base>`` checkpoints train at other
    bases than :data:`BASE`); ``BASE`` if the scheme does not know one."""
    base = getattr(_rope_scheme(model), "base", None)
    return BASE if base is None else float(base)


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
    # NTK-aware at the scale Dynamic NTK reaches at its target length s L (HuggingFace's rule
    # gives s^2 - s + 1 there): the static control that makes "Dynamic beats static" fair
    "ntk-matched": lambda s, L, base, d: {"rope_type": "ntk", "rope_theta": base, "factor": s * s - s + 1},
    # YaRN's frequencies without its temperature: isolates what the attention factor does
    "yarn-no-temp": lambda s, L, base, d: {**_yarn(s, L, base), "attention_factor": 1.0},
    "llama3": lambda s, L, base, d: {"rope_type": "llama3", "rope_theta": base, "factor": s, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": L},
    "longrope": lambda s, L, base, d: {"rope_type": "longrope", "rope_theta": base, "factor": s,
                                       "original_max_position_embeddings": L,
                                       "short_factor": [1.0] * (d // 2), "long_factor": [float(s)] * (d // 2)},
    # ABF (Xiong et al.): plain RoPE with the base raised, where it must be, until Men et al.'s
    # condition holds at the target length s L (companion.recipe.abf_base: 6e4 for the lab's head at
    # 4x; a base that already satisfies it is kept), then continued training like the other methods
    "abf": lambda s, L, base, d: {"rope_type": "default", "rope_theta": _abf_base(s, L, base, d)},
}

METHOD_LABELS = {"none": "no scaling", "pi": "PI (linear)", "ntk": "NTK-aware", "ntk-matched": "NTK at s²-s+1",
                 "dynamic": "Dynamic NTK",
                 "yarn": "YaRN", "yarn-no-temp": "YaRN, no temperature", "llama3": "Llama 3",
                 "longrope": "LongRoPE", "abf": "ABF (base raised)"}

CSV_FIELDS = ["seed", "method", "factor", "finetune_steps", "metric", "length", "where", "value"]


def method_config(method: str, factor: float, train_len: int, head_dim: int, base: float = BASE,
                  long_factor: Sequence[float] | None = None) -> dict[str, Any]:
    """The rope config of ``method`` at scale ``factor`` for a model trained at ``train_len``.

    Raises:
        ValueError: an unknown ``method``, or a ``factor`` below 1, nan or inf (a scaling
            factor stretches the trained range, ``s >= 1``; ``"none"`` is called at 1).
        TypeError: a ``method`` that is not a string, or a ``factor`` that is not a real
            number (a string, a bool, None).
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a name among {list(METHODS)}, got {type(method).__name__} {method!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    factor = check_finite_number(factor, "factor", positive=False)
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (a scaling factor stretches the trained range by s >= 1), got {factor!r}")
    cfg = METHODS[method](factor, int(train_len), float(base), int(head_dim))
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
                    population: int = 12, search_tokens: int = 1 << 15, seed: int = 0) -> dict[str, Any]:
    """Search LongRoPE long factors for scale ``factor`` (see the module doc).

    Candidates are scored by bits per byte on ``search_tokens // (factor * train_len)``
    windows (at least 2) of ``factor * train_len`` bytes of the training split. Each generation keeps the best quarter and fills
    the population with mutants of it (multiplicative log-normal noise of 0.15, one in three
    pairs, then the constraints) and crossovers of two parents. Returns the best factors, their
    score, the starting points' scores and the best score of each generation.
    """
    scheme = _rope_scheme(model)
    d = scheme.rotary_dim
    h = d // 2
    n = int(round(factor * train_len))
    rng = np.random.default_rng(seed)
    check_positive_int(search_tokens, "search_tokens")
    windows_count = max(2, search_tokens // n)
    rows = windows(corpus.train, evenly_spaced_starts(corpus.train.size, n + 1, windows_count), n + 1)
    trained = BASE if scheme.base is None else float(scheme.base)  # a rope-b<base> model's own base
    plain = rope_frequencies(d, trained).double()
    saved = (scheme.rope_spec, scheme.inv_freq, scheme.attention_scaling, scheme.base)

    def starts() -> dict[str, np.ndarray]:
        out = {}
        for name in ("pi", "ntk", "yarn"):
            inv, _ = compute_inv_freq(method_config(name, factor, train_len, d, base=trained), d,
                                      max_position_embeddings=train_len)
            out[name] = (plain / inv.double()).numpy()
        return out

    def legal(f: np.ndarray) -> np.ndarray:
        f = np.clip(f, 1.0, 2.0 * factor)
        return np.maximum.accumulate(f)  # non-decreasing towards the low frequencies

    def score(f: np.ndarray) -> float:
        cfg = method_config("longrope", factor, train_len, d, base=trained, long_factor=f.tolist())
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
            "evaluations": population + generations * (population - max(2, population // 4)),
            "search_windows": windows_count, "search_seed": seed}


@dataclass
class ExtendConfig:
    """What an extension sweep measures, and on how much text.

    The unscaled model is evaluated at ``multiples`` of the training length ``L``. A method at
    scale ``s`` is evaluated at ``L`` (what it costs in distribution) and at its target ``s L``;
    one fine-tuned for ``beyond_steps`` steps also at ``beyond * s L`` (past the length it was
    tuned at) where that is at most ``max(multiples) // 2`` times ``L``. Every length gets the protocol of chapter 8
    (:class:`~companion.lab.sweep.EvalConfig`): ``windows`` tail windows and
    ``sliding_tokens`` sliding bytes in ``blocks`` bootstrap units, passkey retrieval with
    ``passkey_trials`` trials per depth, and attention entropy. LongRoPE's search scores each
    candidate on ``search_tokens`` bytes of the training split.
    """

    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    beyond: float = 2.0
    beyond_steps: list[int] = field(default_factory=lambda: [200])
    windows: int = WINDOWS
    blocks: int = BLOCKS
    sliding_tokens: int = SLIDING_TOKENS
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    passkey_trials: int = 32
    entropy_windows: int = 4
    finetune_lr: float = 1e-3
    search_tokens: int = 1 << 15
    search_seeds: int = 2

    def job_multiples(self, method: str, factor: float, finetune_steps: int) -> list[float]:
        """The multiples of ``L`` a job is evaluated at (see the class docstring)."""
        if method == "none" and finetune_steps == 0:
            return sorted({float(m) for m in self.multiples})
        out = {1.0, float(factor)}
        far = self.beyond * factor
        if finetune_steps in self.beyond_steps and self.beyond > 0 and far <= max(self.multiples) // 2:
            out.add(float(far))
        return sorted(out)


#: The most LongRoPE search seeds per checkpoint and factor: search ``j`` of checkpoint ``i`` has
#: seed ``100 i + j``, and seed ``100 i`` marks the search whose factors the jobs use.
MAX_SEARCH_SEEDS = 100


def check_extend_config(ev: ExtendConfig) -> ExtendConfig:
    """Check ``ev`` without a model or data, so that a command line can refuse it before any
    training: the evaluation protocol (:func:`~companion.lab.sweep.check_protocol`),
    ``beyond`` a finite number >= 0, ``beyond_steps`` ints >= 0, ``finetune_lr`` a finite
    number > 0, ``search_tokens`` an int >= 1 and ``search_seeds`` an int in ``[1, 100]``.
    Returns ``ev``.

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """
    if not isinstance(ev, ExtendConfig):
        raise TypeError(f"ev must be an ExtendConfig, got {type(ev).__name__}")
    check_protocol(ev)
    check_finite_number(ev.beyond, "beyond", minimum=0)
    if ev.beyond_steps:
        _int_list(ev.beyond_steps, "beyond_steps", 0)
    check_finite_number(ev.finetune_lr, "finetune_lr")
    check_positive_int(ev.search_tokens, "search_tokens")
    if check_positive_int(ev.search_seeds, "search_seeds") > MAX_SEARCH_SEEDS:
        raise ValueError(f"search_seeds must be <= {MAX_SEARCH_SEEDS}, got {ev.search_seeds}")
    return ev


def job_lengths(cfg: TrainConfig, ev: ExtendConfig, method: str, factor: float, finetune_steps: int) -> list[int]:
    """The lengths a job evaluates at (:meth:`ExtendConfig.job_multiples` times
    ``cfg.seq_len``), checked to fit the model (``cfg.max_len``) and the evaluation's longest
    length ``max(ev.multiples) * cfg.seq_len``.

    Raises:
        ValueError: a length past either.
    """
    lengths = [int(round(m * cfg.seq_len)) for m in ev.job_multiples(method, factor, finetune_steps)]
    reach = max(ev.multiples) * cfg.seq_len
    if max(lengths) > min(reach, cfg.max_len):
        raise ValueError(
            f"the job reaches length {max(lengths)}, past the model's max_len = {cfg.max_len} or the "
            f"evaluation's longest length max(multiples) * L = {reach}; lower the factor or raise multiples"
        )
    return lengths


def _evaluate(model: TinyDecoder, cfg: TrainConfig, ev: ExtendConfig, corpus: Corpus, lengths: list[int],
              reset: Callable[[], None]) -> tuple[list[tuple[str, int, str, float]], dict[str, Any]]:
    """``(metric, length, where, value)`` rows of means, and the per-unit values behind them
    (``{"tail" | "sliding": {W: [block means]}, "passkey": {W: {depth: {"gain", "exact"}}}}``).
    ``reset`` restores the scheme's state before each evaluation (Dynamic NTK only grows its
    base within one pass over the lengths)."""
    val = corpus.val
    out = []
    units: dict[str, Any] = {"tail": {}, "sliding": {}, "passkey": {}}
    # every job places its windows for the longest length of the sweep, so that jobs with other
    # lengths (and chapter 8's evaluation of the same model) score the very same bytes
    reach = max(ev.multiples) * cfg.seq_len
    reset()
    for w, v in bits_per_byte(model, val, lengths, windows_per_length=ev.windows, blocks=ev.blocks,
                              reach=reach).items():
        out += [("bpb_all", w, "", v["all"]), ("bpb_tail", w, "", v["tail"])]
        units["tail"][str(w)] = _rounded(v["tail_blocks"])
    reset()
    for w, v in sliding_bits_per_byte(model, val, lengths, scored_tokens=ev.sliding_tokens, blocks=ev.blocks,
                                      reach=reach).items():
        out.append(("sliding_bpb", w, "", v["sliding"]))
        units["sliding"][str(w)] = _rounded(v["sliding_blocks"])
    reset()
    res = passkey_retrieval(model, val, lengths, ev.passkey_depths, trials=ev.passkey_trials, seed=cfg.seed)
    for i, w in enumerate(lengths):
        units["passkey"][str(w)] = {}
        for j, depth in enumerate(ev.passkey_depths):
            out += [("passkey_gain", w, f"{depth:g}", res["gain"][i][j]),
                    ("passkey_exact", w, f"{depth:g}", res["exact"][i][j])]
            units["passkey"][str(w)][f"{depth:g}"] = {"gain": _rounded(res["gain_trials"][i][j]),
                                                     "exact": res["exact_trials"][i][j]}
    reset()
    for w, per_layer in attention_entropy(model, val, lengths, windows_per_length=ev.entropy_windows).items():
        out += [("entropy", w, f"layer{li}", e) for li, e in enumerate(per_layer)]
    return out, units


def finetune_fraction(steps: int, cfg: TrainConfig, seq_len: int) -> float:
    """The tokens of a :func:`finetune` of ``steps`` steps at ``seq_len``, as a fraction of the
    pretraining tokens of ``cfg`` (the literature's unit for an extension budget)."""
    batch = max(1, cfg.batch_size * cfg.seq_len // seq_len)
    return steps * batch * seq_len / (cfg.steps * cfg.batch_size * cfg.seq_len)


def extension_job(checkpoint: str, method: str, factor: float, finetune_steps: int, ev: ExtendConfig,
                  long_factor: Sequence[float] | None = None) -> dict[str, Any]:
    """Load ``checkpoint``, install ``method`` at ``factor``, fine-tune, evaluate.

    Returns the rows of means (``rows``), the per-unit values (``units``), the fine-tune log,
    the rope config and the job's seconds.
    """
    t0 = time.perf_counter()
    model, ckpt = load_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(ckpt["config"])
    corpus = load_corpus()
    d = _rope_scheme(model).rotary_dim
    rope_cfg = method_config(method, factor, cfg.seq_len, d, base=_trained_base(model), long_factor=long_factor)
    lengths = job_lengths(cfg, ev, method, factor, finetune_steps)  # before any fine-tuning
    apply_method(model, rope_cfg, cfg.seq_len)
    log: list[dict[str, float]] = []
    if finetune_steps:
        log = finetune(model, cfg, corpus, seq_len=int(round(factor * cfg.seq_len)), steps=finetune_steps,
                       lr=ev.finetune_lr, warmup=min(20, max(1, finetune_steps // 10)), seed=cfg.seed)

    def reset() -> None:
        apply_method(model, rope_cfg, cfg.seq_len)

    means, units = _evaluate(model, cfg, ev, corpus, lengths, reset)
    key = {"seed": cfg.seed, "method": method, "factor": factor, "finetune_steps": finetune_steps}
    rows = [{**key, "metric": m, "length": w, "where": where, "value": f"{v:.6g}"} for m, w, where, v in means]
    return {"rows": rows, "units": {**key, **units}, "finetune_log": log, "rope_config": rope_cfg,
            "seconds": time.perf_counter() - t0}


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


def _cached(cache_dir: str | None, name: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``compute()``, or its result from ``cache_dir/name.json`` when an earlier run left it."""
    if cache_dir is None:
        return compute()
    path = Path(cache_dir) / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


def _job_name(kind: str, checkpoint: str, *parts: Any, ev: dict[str, Any] | None = None) -> str:
    key = json.dumps([kind, Path(checkpoint).name, *parts, ev], sort_keys=True, default=str)
    return f"{kind}-{Path(checkpoint).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _worker(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    kind, cache_dir = args[0], args[1]
    if kind == "search":
        _, _, checkpoint, factor, seed, search_tokens = args

        def search() -> dict[str, Any]:
            model, ckpt = load_checkpoint(checkpoint)
            cfg = TrainConfig.from_dict(ckpt["config"])
            res = longrope_search(model, load_corpus(), factor, cfg.seq_len, seed=seed, search_tokens=search_tokens)
            return {"kind": "search", "checkpoint": checkpoint, "factor": factor, **res}

        return _cached(cache_dir, _job_name("search", checkpoint, factor, seed, search_tokens), search)
    _, _, checkpoint, method, factor, steps, ev, long_factor = args
    return _cached(cache_dir, _job_name("job", checkpoint, method, factor, steps, long_factor, ev=ev),
                   lambda: {"kind": "job", **extension_job(checkpoint, method, factor, steps, ExtendConfig(**ev),
                                                           long_factor)})


def plan_jobs(methods: Sequence[str], factors: Sequence[float], finetune_steps: Sequence[int], *,
              finetune_methods: Sequence[str] | None = None, extra_steps: Sequence[int] = (),
              extra_factors: Sequence[float] = (), extra_methods: Sequence[str] | None = None
              ) -> list[tuple[str, float, int]]:
    """The ``(method, factor, fine-tune steps)`` jobs of one checkpoint, in order.

    Without fine-tuning every method runs at every factor, except ``none``, which does not
    depend on the factor and runs once (at factor 1). Each positive entry of
    ``finetune_steps`` fine-tunes ``finetune_methods`` (default: ``methods``) at every
    factor; each of ``extra_steps`` fine-tunes ``extra_methods`` (default: ``methods``) at
    ``extra_factors`` only (a sweep of the fine-tune length at one scale, say).

    Raises:
        ValueError: an unknown method, or a negative step count.
    """
    ft_methods = list(methods if finetune_methods is None else finetune_methods)
    ex_methods = list(methods if extra_methods is None else extra_methods)
    for m in [*methods, *ft_methods, *ex_methods]:
        if m not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {m!r}")
    for n in [*finetune_steps, *extra_steps]:
        check_positive_int(n, "finetune_steps", 0)
    jobs: list[tuple[str, float, int]] = []
    for steps in finetune_steps:
        for m in (methods if steps == 0 else ft_methods):
            for f in ([1.0] if (m == "none" and steps == 0) else factors):
                jobs.append((m, float(f), int(steps)))
    for steps in extra_steps:
        for m in ex_methods:
            for f in extra_factors:
                if (m, float(f), int(steps)) not in jobs:
                    jobs.append((m, float(f), int(steps)))
    return jobs


def run_extension(checkpoints: Sequence[str], methods: Sequence[str], factors: Sequence[float],
                  finetune_steps: Sequence[int], ev: ExtendConfig, *, finetune_methods: Sequence[str] | None = None,
                  finetune_checkpoints: Sequence[str] | None = None, extra_steps: Sequence[int] = (),
                  extra_factors: Sequence[float] = (), extra_methods: Sequence[str] | None = None, workers: int = 2,
                  cache_dir: str | None = None, verbose: bool = True) -> dict[str, Any]:
    """Every job of :func:`plan_jobs` for every checkpoint; LongRoPE searches first.

    The fine-tuned jobs of ``finetune_steps`` run on ``finetune_checkpoints`` only (default:
    all); the jobs without fine-tuning and the extra ones on every checkpoint.

    With ``"longrope"`` among the methods, ``ev.search_seeds`` searches run per checkpoint and
    factor (their spread is the search's own variance); the jobs use the first. ``none``
    fine-tuned is the baseline that trains plain RoPE at ``s L``. With a ``cache_dir`` every
    finished search and job is kept there, so an interrupted run resumes where it stopped.

    Returns ``{"extend_config": ..., "rows": [...], "units": [...], "searches": [...],
    "finetune_logs": [...], "job_seconds": s, "wall_seconds": s}``: ``rows`` the means (CSV),
    ``units`` each job's per-block and per-trial values.
    """
    plan = plan_jobs(methods, factors, finetune_steps, finetune_methods=finetune_methods, extra_steps=extra_steps,
                     extra_factors=extra_factors, extra_methods=extra_methods)
    tuned = set(checkpoints if finetune_checkpoints is None else finetune_checkpoints)
    unknown = sorted(tuned - set(checkpoints))
    if unknown:
        raise ValueError(f"finetune_checkpoints must be among checkpoints, got {unknown}")
    main_tuned = {(m, f, n) for m, f, n in plan_jobs(methods, factors, finetune_steps,
                                                     finetune_methods=finetune_methods) if n > 0}
    extra = {(m, float(f), int(n)) for m in (methods if extra_methods is None else extra_methods)
             for f in extra_factors for n in extra_steps}

    def wanted(c: str, job: tuple[str, float, int]) -> bool:
        return job not in main_tuned or c in tuned or job in extra
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
                    what = (f"search s={r['factor']:g} seed {r['search_seed']}" if r["kind"] == "search"
                            else f"{r['rope_config']['rope_type']} {r['rows'][0]['method']} s={r['rows'][0]['factor']:g}"
                                 f" ft={r['rows'][0]['finetune_steps']}: {r['seconds']:.0f} s")
                    print(f"[{i + 1}/{len(jobs)}] {what}", flush=True)
            return out

    searches: dict[tuple[str, float], list[float]] = {}
    search_records = []
    longrope_factors = sorted({f for m, f, _ in plan if m == "longrope"})  # as-is jobs: every checkpoint
    if longrope_factors:
        found = run([("search", cache_dir, c, float(f), MAX_SEARCH_SEEDS * i + j, ev.search_tokens)
                     for i, c in enumerate(checkpoints) for f in longrope_factors for j in range(ev.search_seeds)])
        for r in found:
            if r["search_seed"] % MAX_SEARCH_SEEDS == 0:
                searches[(r["checkpoint"], r["factor"])] = r["long_factor"]
            search_records.append({k: v for k, v in r.items() if k != "kind"})
    jobs = [("job", cache_dir, c, m, f, steps, asdict(ev), searches.get((c, f)) if m == "longrope" else None)
            for c in checkpoints for m, f, steps in plan if wanted(c, (m, f, steps))]
    results = run(jobs)
    return {
        "extend_config": asdict(ev),
        "rows": [row for r in results for row in r["rows"]],
        "units": [r["units"] for r in results],
        "searches": search_records,
        "finetune_logs": [{"method": r["rows"][0]["method"], "factor": r["rows"][0]["factor"],
                           "seed": r["rows"][0]["seed"], "steps": r["rows"][0]["finetune_steps"],
                           "log": r["finetune_log"]}
                          for r in results if r["finetune_log"]],
        "job_seconds": sum(r["seconds"] for r in results),
        "wall_seconds": time.perf_counter() - t0,
    }
