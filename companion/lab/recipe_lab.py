"""Chapter 13's lab runs: RoPE bases, and attention temperature against length.

Two of the chapter's four experiments are runs of their own (the other two are
``python -m companion.lab extend --methods abf ...``, ABF beside PI, YaRN and no change at
equal fine-tune budgets, and ``python -m companion.lab sweep --schemes rope-local-global irope
irope-temp ...``, the local/global hybrids of :mod:`companion.lab.schemes`):

* ``bases``: RoPE trained at each base of ``--bases`` (the schemes ``rope-b<base>``, ``rope``
  at 10000), every seed, evaluated at every multiple of the training length as it is and after
  a short fine-tune at ``--factor`` times the training length with the base unchanged (chapter
  9's ``none`` fine-tuned), with chapter 8's protocol (:func:`companion.lab.extend.extension_job`
  with :class:`AllLengths`: every job at every length). The result also holds, per base, what
  :mod:`companion.recipe` predicts for the lab's head: the critical dimension, Liu et al.'s
  extrapolation bound and the longest context Men et al.'s condition allows.
* ``temperature``: trained models evaluated with each attention temperature of
  :data:`TEMPERATURES` (none, log-n, Llama 4's, YaRN's and LongRoPE's factors), training-free:
  attention entropy per layer and tail bits per byte at each length, on the same windows for
  every temperature (paired).

Both keep every finished job in ``<checkpoint-dir>/recipe`` and resume from it, train missing
checkpoints first (:func:`companion.lab.extend.train_missing`), and write results with
provenance. ``--quick`` runs each in about a minute.

The chapter's four runs (``rope`` at full attention is chapter 8's stored sweep, and none, PI
and YaRN at the same fine-tune budgets are chapter 9's)::

    python -m companion.lab.recipe_lab bases --bases 100 1000 3000 10000 100000 1000000 \
        --seeds 0 1 2 --factor 4 --finetune-steps 0 200 --out chapters/data/13_recipe/bases.csv \
        --json chapters/data/13_recipe/bases.json
    python -m companion.lab extend --methods abf --seeds 0 1 2 3 4 --factors 4 \
        --finetune-steps 0 2 10 50 200 --out chapters/data/13_recipe/abf.csv --json chapters/data/13_recipe/abf.json
    python -m companion.lab sweep --schemes rope-local-global irope irope-temp rope-window-nope \
        --seeds 0 1 2 --out chapters/data/13_recipe/hybrids.json
    python -m companion.lab.recipe_lab temperature --schemes rope rope-window-nope irope irope-temp \
        --seeds 0 1 2 --out chapters/data/13_recipe/temperature.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .._checks import check_finite_number, check_positive_int
from .._cli import SMOKE_RUN, apply_quick, check_distinct, check_seeds, save_rows, usage_errors
from ..model import AttentionTemperature, NoPE
from ..recipe import critical_dimension, extrapolation_bound, longest_context, longrope_logit_scale, yarn_logit_scale
from ..utils import save_result
from .corpus import load_corpus
from .evaluate import attention_entropy, bits_per_byte
from .extend import CSV_FIELDS, ExtendConfig, _cached, _job_name, check_extend_config, extension_job, job_lengths, train_missing
from .schemes import rope_base_name, rope_base_of
from .sweep import checkpoint_path
from .train import TrainConfig, load_checkpoint

__all__ = ["AllLengths", "BASES_CSV_FIELDS", "TEMPERATURES", "temperature_for", "base_configs", "run_bases",
           "temperature_job", "run_temperature", "main"]

#: The columns of ``bases``'s CSV: the scheme and its base, then ``companion.lab.extend.CSV_FIELDS``.
BASES_CSV_FIELDS = ["scheme", "base", *CSV_FIELDS]

#: The temperatures ``temperature`` compares, each applied to the model's NoPE layers if it has
#: any (Llama 4's practice), else to every layer: ``trained`` (the model as trained), ``none``
#: (no temperature: removes a trained one), ``log-n`` (``max(1, ln(p + 1) / ln L)`` per query
#: position), ``llama4`` (Llama 4's form with ``floor_scale = L``: 1 within the training length),
#: ``yarn`` and ``longrope`` (their logit factors at ``s = W / L`` for a window of ``W`` bytes,
#: one constant per length). See :class:`companion.model.AttentionTemperature`.
TEMPERATURES: tuple[str, ...] = ("trained", "none", "log-n", "llama4", "yarn", "longrope")


@dataclass
class AllLengths(ExtendConfig):
    """:class:`~companion.lab.extend.ExtendConfig` whose every job, fine-tuned or not, is
    evaluated at every one of ``multiples`` (chapter 13 asks for 16x after a fine-tune at 4x;
    chapter 9's jobs stop at twice their target)."""

    def job_multiples(self, method: str, factor: float, finetune_steps: int) -> list[float]:
        return sorted({float(m) for m in self.multiples})


def temperature_for(name: str, length: int, train_len: int) -> AttentionTemperature | None:
    """The temperature ``name`` (a key of :data:`TEMPERATURES` but ``trained``) for windows of
    ``length`` bytes of a model trained at ``train_len``; ``None`` for ``none``.

    Raises:
        ValueError: an unknown name (``trained`` included: it is the model's own), or a length
            or ``train_len`` below 2.
        TypeError: a length that is not an int.
    """
    w = check_positive_int(length, "length", 2)
    L = check_positive_int(train_len, "train_len", 2)
    if name == "none":
        return None
    if name == "log-n":
        return AttentionTemperature("log-n", length=L)
    if name == "llama4":
        return AttentionTemperature("llama4", length=L, strength=0.1)
    if name == "yarn":
        return AttentionTemperature("constant", strength=yarn_logit_scale(w / L))
    if name == "longrope":
        return AttentionTemperature("constant", strength=longrope_logit_scale(w / L, L))
    raise ValueError(f"temperature must be one of {[t for t in TEMPERATURES if t != 'trained']} here, got {name!r}")


def base_configs(bases: Sequence[float], seeds: Sequence[int], **train: Any) -> list[TrainConfig]:
    """One :class:`~companion.lab.train.TrainConfig` per base and seed (scheme
    :func:`~companion.lab.schemes.rope_base_name`: ``rope`` at 10000, ``rope-b<base>``
    otherwise), the other fields from ``train``."""
    return [TrainConfig(scheme=rope_base_name(b), seed=s, **train) for b in bases for s in seeds]


def _base_worker(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    cache_dir, checkpoint, factor, steps, ev = args
    return _cached(cache_dir, _job_name("bases", checkpoint, "none", factor, steps, ev=ev),
                   lambda: {"checkpoint": Path(checkpoint).name,
                            **extension_job(checkpoint, "none", factor, steps, AllLengths(**ev))})


def _pool_map(fn, jobs: list, workers: int, label, verbose: bool) -> list:
    if workers <= 1 or len(jobs) <= 1:
        out = []
        for i, job in enumerate(jobs):
            out.append(fn(job))
            if verbose:
                print(f"[{i + 1}/{len(jobs)}] {label(out[-1])}", flush=True)
        return out
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        out = []
        for i, r in enumerate(pool.imap(fn, jobs)):
            out.append(r)
            if verbose:
                print(f"[{i + 1}/{len(jobs)}] {label(r)}", flush=True)
        return out


def run_bases(checkpoints: Sequence[str], factor: float, finetune_steps: Sequence[int], ev: AllLengths, *,
              workers: int = 2, cache_dir: str | None = None, verbose: bool = True) -> dict[str, Any]:
    """Every job of the ``bases`` experiment on trained RoPE checkpoints: each as it is (factor
    1, no fine-tune) and, for each positive entry of ``finetune_steps``, fine-tuned at
    ``factor`` times its training length with its base unchanged, all evaluated at every one
    of ``ev.multiples``.

    Returns ``{"rows", "units", "finetune_logs", "bounds", "eval_config", "job_seconds",
    "wall_seconds"}``: ``rows`` for :data:`BASES_CSV_FIELDS`; ``bounds`` per scheme its base,
    head size and training length with :func:`~companion.recipe.critical_dimension`,
    :func:`~companion.recipe.extrapolation_bound` and
    :func:`~companion.recipe.longest_context` (up to 64 times the training length).

    Raises:
        TypeError, ValueError: a bad ``factor`` (a finite number >= 1), step count or ``ev``.
    """
    if not isinstance(ev, AllLengths):
        raise TypeError(f"ev must be an AllLengths, got {type(ev).__name__}")
    check_extend_config(ev)
    factor = check_finite_number(factor, "factor", minimum=1)
    steps = [check_positive_int(n, "finetune_steps", 0) for n in finetune_steps]
    t0 = time.perf_counter()
    jobs = [(cache_dir, str(c), 1.0, 0, asdict(ev)) for c in checkpoints]
    jobs += [(cache_dir, str(c), factor, n, asdict(ev)) for c in checkpoints for n in steps if n > 0]
    results = _pool_map(_base_worker, jobs, workers,
                        lambda r: f"{r['checkpoint']} s={r['rows'][0]['factor']:g} "
                                  f"ft={r['rows'][0]['finetune_steps']}: {r['seconds']:.0f} s", verbose)
    rows, units, logs, bounds = [], [], [], {}
    for (_, ckpt, f, n, _), r in zip(jobs, results):
        cfg = TrainConfig.from_dict(_stored_config(ckpt))
        base = rope_base_of(cfg.scheme)
        head = cfg.d_model // cfg.n_heads
        rows += [{"scheme": cfg.scheme, "base": f"{base:g}", **row} for row in r["rows"]]
        units.append({"scheme": cfg.scheme, "base": base, **r["units"]})
        if r["finetune_log"]:
            logs.append({"scheme": cfg.scheme, "seed": cfg.seed, "factor": f, "steps": n, "log": r["finetune_log"]})
        bounds[cfg.scheme] = {"base": base, "head_dim": head, "train_len": cfg.seq_len,
                              "critical_dimension": critical_dimension(head, cfg.seq_len, base),
                              "extrapolation_bound": extrapolation_bound(head, cfg.seq_len, base),
                              "longest_context": longest_context(base, head, limit=64 * cfg.seq_len)}
    return {"eval_config": asdict(ev), "rows": rows, "units": units, "finetune_logs": logs, "bounds": bounds,
            "job_seconds": sum(r["seconds"] for r in results), "wall_seconds": time.perf_counter() - t0}


def _stored_config(path: str) -> dict[str, Any]:
    """The training config stored in a checkpoint (read without building the model)."""
    return torch.load(path, map_location="cpu", weights_only=True)["config"]


def _temperature_layers(model: torch.nn.Module) -> list[int]:
    """The layers a temperature goes to: the NoPE layers if any, else every layer."""
    blocks = list(model.blocks)
    nope = [i for i, b in enumerate(blocks) if type(b.attn.scheme) is NoPE]
    return nope or list(range(len(blocks)))


def temperature_job(checkpoint: str, temperatures: Sequence[str], multiples: Sequence[int], *, windows: int = 256,
                    blocks: int = 32, entropy_windows: int = 8) -> dict[str, Any]:
    """One trained model with each of ``temperatures`` (names of :data:`TEMPERATURES`) at each
    multiple of its training length: attention entropy in bits per layer (the last 64 queries
    of ``entropy_windows`` windows, :func:`~companion.lab.evaluate.attention_entropy`) and tail
    bits per byte with its ``blocks`` block means (``windows`` windows placed for the longest
    length, :func:`~companion.lab.evaluate.bits_per_byte`); the same windows for every
    temperature. Returns ``{"config", "layers", "results": {name: {length: {"entropy",
    "tail", "tail_blocks", "tau_last"}}}, "seconds"}``, ``layers`` the layers that got the
    temperatures and ``tau_last`` the temperature of the window's last query. A model
    trained without a temperature is measured once for ``trained`` and ``none``, which are
    then the same model.
    """
    t0 = time.perf_counter()
    model, ckpt = load_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(ckpt["config"])
    val = load_corpus().val
    L = cfg.seq_len
    lengths = [int(m) * L for m in multiples]
    reach = max(lengths)
    targets = _temperature_layers(model)
    trained = [b.attn.temperature for b in model.blocks]
    results: dict[str, Any] = {}
    untrained = all(t is None for t in trained)  # then "trained" and "none" are the same model
    for name in temperatures:
        twin = {"trained": "none", "none": "trained"}.get(name)
        if untrained and twin in results:
            results[name] = results[twin]  # the same windows, the same model: measured once
            continue
        per: dict[str, Any] = {}
        for w in lengths:
            for i, block in enumerate(model.blocks):
                block.attn.temperature = trained[i] if (name == "trained" or i not in targets) else \
                    temperature_for(name, w, L)
            probe = model.blocks[targets[-1]].attn.temperature
            tau_last = 1.0 if probe is None else float(probe.scales(torch.tensor([w - 1]))[0])
            ent = attention_entropy(model, val, [w], windows_per_length=entropy_windows)[w]
            bpb = bits_per_byte(model, val, [w], windows_per_length=windows, blocks=blocks, reach=reach)[w]
            per[str(w)] = {"entropy": [round(e, 5) for e in ent], "tail": bpb["tail"],
                           "tail_blocks": [round(v, 4) for v in bpb["tail_blocks"]], "tau_last": tau_last}
        results[name] = per
    for i, block in enumerate(model.blocks):
        block.attn.temperature = trained[i]
    return {"config": asdict(cfg), "layers": targets, "results": results, "seconds": time.perf_counter() - t0}


def _temperature_worker(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    cache_dir, checkpoint, temperatures, multiples, kw = args
    return _cached(cache_dir, _job_name("temperature", checkpoint, temperatures, multiples, ev=kw),
                   lambda: temperature_job(checkpoint, temperatures, multiples, **kw))


def run_temperature(checkpoints: Sequence[str], temperatures: Sequence[str], multiples: Sequence[int], *,
                    windows: int = 256, blocks: int = 32, entropy_windows: int = 8, workers: int = 2,
                    cache_dir: str | None = None, verbose: bool = True) -> dict[str, Any]:
    """:func:`temperature_job` on every checkpoint, in ``workers`` processes.

    Returns ``{"runs": [...], "temperatures", "multiples", "windows", "blocks",
    "entropy_windows", "job_seconds", "wall_seconds"}``.

    Raises:
        ValueError: an unknown temperature name or a repeated one; bad counts.
    """
    for t in temperatures:
        if t not in TEMPERATURES:
            raise ValueError(f"temperatures must be names among {list(TEMPERATURES)}, got {t!r}")
    check_distinct(temperatures, "temperatures")
    for name, value in (("windows", windows), ("blocks", blocks), ("entropy_windows", entropy_windows)):
        check_positive_int(value, name)
    if windows % blocks:
        raise ValueError(f"blocks ({blocks}) must divide windows ({windows})")
    t0 = time.perf_counter()
    kw = {"windows": windows, "blocks": blocks, "entropy_windows": entropy_windows}
    jobs = [(cache_dir, str(c), list(temperatures), [int(m) for m in multiples], kw) for c in checkpoints]
    runs = _pool_map(_temperature_worker, jobs, workers,
                     lambda r: f"{r['config']['scheme']} seed {r['config']['seed']}: {r['seconds']:.0f} s", verbose)
    return {"runs": runs, "temperatures": list(temperatures), "multiples": [int(m) for m in multiples], **kw,
            "job_seconds": sum(r["seconds"] for r in runs), "wall_seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- command line

#: What ``bases --quick`` sets: three bases, one seed, 100 training steps, a 10-step fine-tune,
#: and the quick evaluation of ``python -m companion.lab extend --quick``.
QUICK_BASES: dict[str, object] = {
    "bases": [100.0, 10000.0, 1000000.0], "seeds": [0], "steps": 100, "warmup": 10, "finetune_steps": [0, 10],
    "checkpoint_dir": "runs/lab-quick", "multiples": [1, 2, 4], "windows": 32, "blocks": 8, "sliding_tokens": 1024,
    "passkey_depths": [0.5], "passkey_trials": 4, "entropy_windows": 2,
}

#: What ``temperature --quick`` sets: one RoPE model trained as ``sweep --quick`` trains it,
#: three temperatures, a sliver of text at 1x, 2x and 4x.
QUICK_TEMPERATURE: dict[str, object] = {
    "schemes": ["rope"], "seeds": [0], "steps": 100, "warmup": 10, "checkpoint_dir": "runs/lab-quick",
    "temperatures": ["none", "log-n", "yarn"], "multiples": [1, 2, 4], "windows": 32, "blocks": 8,
    "entropy_windows": 2,
}

_PROTOCOL_SKIP = ("beyond", "beyond_steps", "search_tokens", "search_seeds")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from .__main__ import _add_dataclass_options, _add_quick

    parser = argparse.ArgumentParser(prog="python -m companion.lab.recipe_lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_b = sub.add_parser("bases", help="RoPE at several bases, evaluated to 16x as is and after a short fine-tune")
    p_b.add_argument("--bases", type=float, nargs="+", default=[100.0, 1000.0, 3000.0, 10000.0, 100000.0, 1000000.0],
                     help="RoPE bases, each > 1; 10000 is the scheme rope (default: 100 1000 3000 10000 100000 1000000)")
    p_b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every base (default: 0 1 2)")
    p_b.add_argument("--factor", type=float, default=4.0,
                     help="the fine-tune runs at factor * seq-len bytes, base unchanged (default: 4)")
    p_b.add_argument("--finetune-steps", type=int, nargs="+", default=[0, 200],
                     help="fine-tune lengths in steps, 0 = as trained (default: 0 200)")
    p_b.add_argument("--checkpoint-dir", default="runs/lab", help="where checkpoints are kept and reused (default: runs/lab)")
    p_b.add_argument("--workers", type=int, default=2, help="worker processes, one job each (default: 2)")
    p_b.add_argument("--out", required=True, help="CSV file of the measurements, with provenance (required)")
    p_b.add_argument("--json", default=None, help="JSON file for the per-unit values, fine-tune logs and bounds (default: none)")
    _add_quick(p_b, QUICK_BASES)
    _add_dataclass_options(p_b, TrainConfig, skip=("scheme", "seed"))
    _add_dataclass_options(p_b, ExtendConfig, skip=_PROTOCOL_SKIP)

    p_t = sub.add_parser("temperature", help="attention entropy and tail loss against length with each temperature")
    p_t.add_argument("--schemes", nargs="+", default=["rope", "rope-window-nope", "irope", "irope-temp"],
                     help="lab schemes of the models (default: rope rope-window-nope irope irope-temp)")
    p_t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every scheme (default: 0 1 2)")
    p_t.add_argument("--temperatures", nargs="+", default=list(TEMPERATURES),
                     help=f"names among {list(TEMPERATURES)} (default: all)")
    p_t.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                     help="lengths as multiples of seq-len (default: 1 2 4 8 16)")
    p_t.add_argument("--windows", type=int, default=256, help="tail windows per length (default: 256)")
    p_t.add_argument("--blocks", type=int, default=32, help="bootstrap blocks of the tail windows (default: 32)")
    p_t.add_argument("--entropy-windows", type=int, default=8, help="windows whose entropy is measured per length (default: 8)")
    p_t.add_argument("--checkpoint-dir", default="runs/lab", help="where checkpoints are kept and reused (default: runs/lab)")
    p_t.add_argument("--workers", type=int, default=2, help="worker processes, one model each (default: 2)")
    p_t.add_argument("--out", required=True, help="JSON file of the results, with provenance (required)")
    _add_quick(p_t, QUICK_TEMPERATURE)
    _add_dataclass_options(p_t, TrainConfig, skip=("scheme", "seed"))
    return parser, {"bases": p_b, "temperature": p_t}


def _check_bases(p: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[list[TrainConfig], AllLengths]:
    from .__main__ import _picked, _train_config

    train = _train_config(p, ns, skip=("scheme", "seed"))
    with usage_errors(p, "--bases"):
        check_distinct([rope_base_name(b) for b in ns.bases], "bases")
    with usage_errors(p, "--seeds"):
        seeds = check_seeds(ns.seeds, "seeds")
    with usage_errors(p, "--factor"):
        check_finite_number(ns.factor, "factor", minimum=1)
    with usage_errors(p, "--finetune-steps"):
        for n in ns.finetune_steps:
            check_positive_int(n, "finetune-steps", 0)
        check_distinct(ns.finetune_steps, "finetune-steps")
    ev = AllLengths(**_picked(ns, ExtendConfig, skip=_PROTOCOL_SKIP))
    with usage_errors(p, configs=(ExtendConfig,)):
        check_extend_config(ev)
    configs = base_configs(ns.bases, seeds, **train)
    with usage_errors(p, configs=(ExtendConfig, TrainConfig)):
        job_lengths(configs[0], ev, "none", 1.0, 0)
    return configs, ev


def _check_temperature(p: argparse.ArgumentParser, ns: argparse.Namespace) -> list[TrainConfig]:
    from .__main__ import _check_schemes, _train_config

    train = _train_config(p, ns, skip=("scheme", "seed"))
    cfg = TrainConfig(**train)
    with usage_errors(p, "--schemes"):
        check_distinct(ns.schemes, "schemes")
        _check_schemes(ns.schemes, cfg)
    with usage_errors(p, "--seeds"):
        seeds = check_seeds(ns.seeds, "seeds")
    with usage_errors(p, "--temperatures"):
        for t in ns.temperatures:
            if t not in TEMPERATURES:
                raise ValueError(f"temperatures must be names among {list(TEMPERATURES)}, got {t!r}")
        check_distinct(ns.temperatures, "temperatures")
    with usage_errors(p, "--multiples"):
        for m in ns.multiples:
            check_positive_int(m, "multiples")
        check_distinct(ns.multiples, "multiples")
        if max(ns.multiples) * cfg.seq_len > cfg.max_len:
            raise ValueError(f"the longest length {max(ns.multiples) * cfg.seq_len} (max(multiples) * seq-len) is past "
                             f"--max-len {cfg.max_len}")
        if min(ns.multiples) * cfg.seq_len < 2:
            raise ValueError("every length must be at least 2 bytes")
    for flag in ("windows", "blocks", "entropy_windows"):
        with usage_errors(p, "--" + flag.replace("_", "-")):
            check_positive_int(getattr(ns, flag), flag.replace("_", "-"))
    with usage_errors(p, "--blocks"):
        if ns.windows % ns.blocks:
            raise ValueError(f"blocks ({ns.blocks}) must divide --windows ({ns.windows})")
    return [TrainConfig(scheme=s, seed=seed, **train) for s in ns.schemes for seed in seeds]


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.lab.recipe_lab bases|temperature ...`` (see the module docstring)."""
    from .__main__ import _check_common

    argv = sys.argv[1:] if argv is None else argv
    command = "python -m companion.lab.recipe_lab " + " ".join(shlex.quote(a) for a in argv)
    parser, subs = _parser()
    ns = parser.parse_args(argv)
    p = subs[ns.cmd]
    quick = ns.quick
    if quick:
        ns = apply_quick(parser, p, argv, ns, QUICK_BASES if ns.cmd == "bases" else QUICK_TEMPERATURE)
    _check_common(p, ns)
    cache = str(Path(ns.checkpoint_dir) / "recipe")
    if ns.cmd == "bases":
        configs, ev = _check_bases(p, ns)
        paths = [str(checkpoint_path(ns.checkpoint_dir, c)) for c in configs]
        train_missing(configs, paths, workers=ns.workers)
        result = run_bases(paths, ns.factor, ns.finetune_steps, ev, workers=ns.workers, cache_dir=cache)
        save_rows(ns.out, ns.json, result, BASES_CSV_FIELDS, command=command, quick=quick)
        print(f"bases: {len(result['rows'])} rows in {result['wall_seconds']:.0f} s -> {ns.out}")
    else:
        configs = _check_temperature(p, ns)
        paths = [str(checkpoint_path(ns.checkpoint_dir, c)) for c in configs]
        train_missing(configs, paths, workers=ns.workers)
        result = run_temperature(paths, ns.temperatures, ns.multiples, windows=ns.windows, blocks=ns.blocks,
                                 entropy_windows=ns.entropy_windows, workers=ns.workers, cache_dir=cache)
        save_result(ns.out, {**result, "quick": True} if quick else result, command=command)
        print(f"temperature: {len(result['runs'])} models in {result['wall_seconds']:.0f} s -> {ns.out}")
    if quick:
        print(f"{SMOKE_RUN}: {ns.out} records \"quick\": true")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
