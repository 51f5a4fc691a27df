"""``python -m companion.lab train|eval|sweep|extend|trainfree ...``: the lab's command line.

Examples::

    # one scheme, one seed: train, save a checkpoint, evaluate, write JSON
    python -m companion.lab train --scheme rope --seed 0 --checkpoint runs/rope.pt --out rope.json
    # evaluate a saved checkpoint again
    python -m companion.lab eval --checkpoint runs/rope.pt --out rope-eval.json
    # chapter 8's sweep, stored in parts (one file per command) that load_sweep merges; one part:
    python -m companion.lab sweep --schemes rope alibi --seeds 0 1 2 3 4 --workers 2 \
        --out chapters/data/08_sweep/rope-alibi.json
    # chapter 9: every RoPE scaling method at 2x, 4x, 8x without fine-tuning (the run's first
    # part; its fine-tuned parts are other extend commands into the same folder)
    python -m companion.lab extend --seeds 0 1 2 3 4 --factors 2 4 8 --finetune-steps 0 \
        --out chapters/data/09_extension/1-as-is.csv --json chapters/data/09_extension/1-as-is.json
    # chapter 11: training-free extension (ReRoPE, Self-Extend, attention sinks) of the RoPE models
    python -m companion.lab trainfree --seeds 0 1 --out chapters/data/11_trainfree_lab/two-seeds.json
    # your own encoding beside the baselines: a smoke run of about a minute first, then the sweep
    python -m companion.lab sweep --schemes rope mypkg.enc:MyScheme --quick
    python -m companion.lab sweep --schemes nope rope alibi mypkg.enc:MyScheme --seeds 0 1 --out mine.json

Every field of :class:`~companion.lab.train.TrainConfig` is an option (``--steps 500``,
``--seq-len 64``, ...). ``sweep --quick`` and ``extend --quick`` set small values
(:data:`QUICK_SWEEP`, :data:`QUICK_EXTEND`) for a smoke run of about a minute; explicit flags
override them, and the files written record ``"quick": true``. ``train`` runs under
``torchrun`` too (DistributedDataParallel)::

    torchrun --nproc-per-node 2 -m companion.lab train --scheme rope --checkpoint runs/rope.pt
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import torch

import torch.distributed as dist

from .._checks import check_finite_number, check_positive_int
from .._cli import (QUICK_HELP, SMOKE_RUN, apply_quick, as_flags, check_distinct, check_existing_file,
                    check_file_target, check_folder_target, check_seeds, preset_text, save_rows, usage_errors)
from ..utils import save_result
from .corpus import load_corpus
from .evaluate import BLOCKS
from .extend import (CSV_FIELDS, METHODS, ExtendConfig, check_extend_config, job_lengths, plan_jobs, run_extension,
                     train_missing)
from .schemes import BUILTIN, build_scheme
from .sweep import EvalConfig, check_eval_config, checkpoint_path, evaluate_model, run_sweep
from .train import TrainConfig, load_checkpoint, train


#: What each config field means, for ``--help`` (every field of TrainConfig, EvalConfig and
#: ExtendConfig is an option; tests/test_cli_help.py checks that each has a line here).
FIELD_HELP = {
    # TrainConfig
    "scheme": "position scheme: a built-in name or package.module:ClassName",
    "seed": "random seed of the initialisation and the data order",
    "d_model": "model width",
    "n_heads": "attention heads per layer",
    "n_layers": "decoder layers",
    "seq_len": "training length in bytes (the evaluations' lengths are multiples of it)",
    "max_len": "longest sequence the model is built for (learned tables have this many rows)",
    "batch_size": "windows per training step",
    "steps": "training steps",
    "lr": "peak learning rate (AdamW; linear warm-up, then cosine decay)",
    "min_lr_ratio": "final learning rate as a fraction of the peak",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient-norm clip",
    "retrieval_fraction": "probability that a training window carries a key and its later queries to copy",
    "retrieval_queries": "queries of the key per such window",
    "dtype": "parameter dtype: float32 or float64",
    # EvalConfig and ExtendConfig
    "multiples": "evaluation lengths, as multiples of seq_len",
    "windows": "evaluation windows per length (their last 64 bytes are the tail metric)",
    "blocks": "blocks of neighbouring windows, the units a confidence interval resamples",
    "sliding_tokens": "bytes scored per length by the sliding window",
    "passkey_multiples": "passkey lengths, as multiples of seq_len",
    "passkey_depths": "where the key sits: 0 = at the start of the window, 1 = just before the query",
    "passkey_trials": "passkey trials per (length, depth) cell",
    "entropy_windows": "windows whose attention entropy is measured per length",
    "beyond": "extension only: the factor of the extra 'beyond' evaluation, relative to the target length",
    "beyond_steps": "extension only: fine-tune lengths that also get the 'beyond' evaluation",
    "finetune_lr": "extension only: learning rate of the short fine-tune at the target length",
    "search_tokens": "extension only: bytes LongRoPE's factor search scores each candidate on",
    "search_seeds": "extension only: independent LongRoPE searches per model (the spread is reported)",
}


#: What ``sweep --quick`` sets (each overridden by an explicit flag): two schemes, one seed, 100
#: steps of the chapter's model (so that a scheme is tried at the shape the real sweep trains),
#: and every evaluation on a sliver of text at 1x, 2x and 4x; checkpoints in a folder of their
#: own, apart from the real runs'.
QUICK_SWEEP: dict[str, object] = {
    "schemes": ["rope", "alibi"], "seeds": [0], "steps": 100, "warmup": 10, "checkpoint_dir": "runs/lab-quick",
    "multiples": [1, 2, 4], "windows": 32, "blocks": 8, "sliding_tokens": 1024, "passkey_multiples": [1, 4],
    "passkey_depths": [0.5], "passkey_trials": 4, "entropy_windows": 2,
}

#: What ``extend --quick`` sets: one RoPE model trained as ``sweep --quick`` trains it (the same
#: checkpoint folder, so one quick sweep's model serves both), three methods at 2x, without and
#: with a 10-step fine-tune, and the quick evaluation.
QUICK_EXTEND: dict[str, object] = {
    "seeds": [0], "steps": 100, "warmup": 10, "checkpoint_dir": "runs/lab-quick", "methods": ["none", "pi", "yarn"],
    "factors": [2.0], "finetune_steps": [0, 10], "multiples": [1, 2, 4], "windows": 32, "blocks": 8,
    "sliding_tokens": 1024, "passkey_depths": [0.5], "passkey_trials": 4, "entropy_windows": 2,
    "search_tokens": 1024, "search_seeds": 1,
}


#: The subcommands with a ``--quick`` preset.
QUICK = {"sweep": QUICK_SWEEP, "extend": QUICK_EXTEND}


def _add_quick(parser: argparse.ArgumentParser, preset: dict[str, object]) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_HELP}; sets {preset_text(preset)} (default: off, the real run)")


def _add_dataclass_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    for f in fields(cls):
        if f.name in skip:
            continue
        default = getattr(cls(), f.name)
        flag = "--" + f.name.replace("_", "-")
        meaning = FIELD_HELP[f.name]  # every field has one (tests/test_cli_help.py)
        if isinstance(default, list):
            kind = type(default[0]) if default else int
            parser.add_argument(flag, type=kind, nargs="+", default=None,
                                help=f"{meaning} (default: {' '.join(map(str, default))})")
        else:
            parser.add_argument(flag, type=type(default), default=None, help=f"{meaning} (default: {default})")


def _picked(ns: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict:
    return {f.name: getattr(ns, f.name) for f in fields(cls)
            if f.name not in skip and getattr(ns, f.name, None) is not None}


# ----------------------------------------------------------------------------- argument checks
# Every subcommand checks all of its arguments before it trains or loads anything; a bad one
# is the subcommand's usage error (exit 2) naming the flag, not a traceback minutes later.


def _train_config(parser: argparse.ArgumentParser, ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    """The TrainConfig options given, checked by TrainConfig itself (scheme and seed: defaults)."""
    base = _picked(ns, TrainConfig, skip=skip)
    with usage_errors(parser, configs=(TrainConfig,)):
        TrainConfig(**base)
    return base


def _check_schemes(names: list[str], cfg: TrainConfig) -> None:
    """Build each scheme once at the config's shape: an unknown name, a ``module:Class`` that
    does not import or a constructor the lab cannot call fails here, before any training."""
    for name in names:
        build_scheme(name, d_model=cfg.d_model, n_heads=cfg.n_heads, max_len=cfg.max_len, train_len=cfg.seq_len)


def _check_names(values: list[str], known: list[str], name: str, allow_all: bool = False) -> list[str]:
    """Names among ``known`` (or ``["all"]``, which means all of them), none twice."""
    if allow_all and values == ["all"]:
        return list(known)
    for v in values:
        if v not in known:
            extra = " or 'all' alone" if allow_all else ""
            raise ValueError(f"{name} must be names among {known}{extra}, got {v!r}")
    return check_distinct(values, name)


def _check_eval(parser: argparse.ArgumentParser, ns: argparse.Namespace, cfg: TrainConfig | None) -> EvalConfig:
    with usage_errors(parser, configs=(EvalConfig, TrainConfig) if cfg is not None else (EvalConfig,)):
        ev = EvalConfig(**_picked(ns, EvalConfig))  # checks its fields
        check_eval_config(ev, cfg)
    return ev


def _check_parent(path: str | None, name: str) -> None:
    """Require that the folder of ``path`` can exist: no existing ancestor of it is a file
    (``out/x.json`` where ``out`` is a file could never be written; ``None`` passes)."""
    if path is None:
        return
    for parent in Path(path).parents:  # nearest first
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{name} must be a path in a folder, got {str(path)!r}, which lies under "
                                 f"the existing file {str(parent)!r}")
            return


def _check_common(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``--workers``/``--threads``, ``--out``/``--json`` and ``--checkpoint-dir``, where the
    subcommand has them."""
    with usage_errors(parser):
        for flag in ("workers", "threads"):
            if hasattr(ns, flag):
                check_positive_int(getattr(ns, flag), "--" + flag)
        for flag in ("out", "json"):
            check_file_target(getattr(ns, flag, None), "--" + flag)
            _check_parent(getattr(ns, flag, None), "--" + flag)
        check_folder_target(getattr(ns, "checkpoint_dir", None), "--checkpoint-dir")
        _check_parent(getattr(ns, "checkpoint_dir", None), "--checkpoint-dir")


def _check_sweep(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[list[TrainConfig], EvalConfig]:
    base = _train_config(parser, ns, skip=("scheme", "seed"))
    cfg = TrainConfig(**base)
    if ns.schemes == ["all"]:
        schemes = list(BUILTIN)
    else:
        with usage_errors(parser, "--schemes"):
            if "all" in ns.schemes:
                raise ValueError(f"'all' must stand alone, got {ns.schemes}")
            schemes = check_distinct(ns.schemes, "schemes")
            _check_schemes(schemes, cfg)
    with usage_errors(parser, "--seeds"):
        seeds = {s: check_seeds(ns.seeds, "seeds") for s in schemes}
    given: set[str] = set()
    for item in ns.seeds_per_scheme:
        name, eq, count = item.partition("=")
        if not eq or name not in seeds or not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
            parser.error(f"argument --seeds-per-scheme: takes SCHEME=N with SCHEME among --schemes {schemes} "
                         f"and N >= 1, got {item!r}")
        if name in given:
            parser.error(f"argument --seeds-per-scheme: names {name!r} twice, got {ns.seeds_per_scheme}")
        given.add(name)
        seeds[name] = list(range(int(count)))
    ev = _check_eval(parser, ns, cfg)
    return [TrainConfig(scheme=s, seed=seed, **base) for s in schemes for seed in seeds[s]], ev


def _check_extend(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict:
    base = _train_config(parser, ns, skip=("scheme", "seed"))
    with usage_errors(parser, "--seeds"):
        seeds = check_seeds(ns.seeds, "seeds")
    checks = {"--methods": (ns.methods, True), "--finetune-methods": (ns.finetune_methods, False),
              "--extra-methods": (ns.extra_methods, False)}
    for flag, (values, allow_all) in checks.items():
        if values is not None:
            with usage_errors(parser, flag):
                _check_names(values, list(METHODS), flag.lstrip("-"), allow_all)
    methods = list(METHODS) if ns.methods == ["all"] else ns.methods
    for flag, values in (("--factors", ns.factors), ("--extra-factors", ns.extra_factors or [])):
        with usage_errors(parser, flag):
            for f in values:
                check_finite_number(f, flag.lstrip("-"), minimum=1)  # the scaling methods' s >= 1
            check_distinct(values, flag.lstrip("-"))
    for flag, values in (("--finetune-steps", ns.finetune_steps), ("--extra-steps", ns.extra_steps)):
        with usage_errors(parser, flag):
            for n in values:
                check_positive_int(n, flag.lstrip("-"), 0)
            check_distinct(values, flag.lstrip("-"))
    if ns.finetune_seeds is not None:
        with usage_errors(parser, "--finetune-seeds"):
            check_seeds(ns.finetune_seeds, "finetune-seeds")
            if not set(ns.finetune_seeds) <= set(seeds):
                raise ValueError(f"finetune-seeds must be among --seeds {seeds}, got {ns.finetune_seeds}")
    tuned = any(n > 0 for n in ns.finetune_steps)
    for flag, value, needs, ok in (("--finetune-methods", ns.finetune_methods, "a --finetune-steps > 0", tuned),
                                   ("--finetune-seeds", ns.finetune_seeds, "a --finetune-steps > 0", tuned),
                                   ("--extra-factors", ns.extra_factors, "--extra-steps", bool(ns.extra_steps)),
                                   ("--extra-methods", ns.extra_methods, "--extra-steps", bool(ns.extra_steps))):
        if value is not None and not ok:
            parser.error(f"argument {flag}: applies only with {needs}, which is not given (it would be ignored)")
    ev = ExtendConfig(**_picked(ns, ExtendConfig))
    with usage_errors(parser, configs=(ExtendConfig,)):
        check_extend_config(ev)
    extra_factors = [4.0] if ns.extra_factors is None else ns.extra_factors
    plan = plan_jobs(methods, ns.factors, ns.finetune_steps, finetune_methods=ns.finetune_methods,
                     extra_steps=ns.extra_steps, extra_factors=extra_factors, extra_methods=ns.extra_methods)
    cfg = TrainConfig(scheme="rope", **base)
    for method, factor, steps in plan:
        try:
            job_lengths(cfg, ev, method, factor, steps)
        except ValueError as exc:
            text = as_flags(str(exc), (ExtendConfig, TrainConfig))
            if method != "none":  # "none" runs once, at every multiple: the factor is not the cause
                where = "--factors" if factor in ns.factors else "--extra-factors"
                text = f"argument {where}: {method} at factor {factor:g}, fine-tuned for {steps} steps: {text}"
            parser.error(text)
    return {"base": base, "seeds": seeds, "methods": methods, "extra_factors": extra_factors, "ev": ev}


def _check_trainfree(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[dict, list[int], list | None]:
    from .trainfree_lab import LAB_TRAINFREE
    base = _train_config(parser, ns, skip=("scheme", "seed"))
    with usage_errors(parser, "--seeds"):
        seeds = check_seeds(ns.seeds, "seeds")
    with usage_errors(parser, "--methods"):
        names = _check_names(ns.methods, list(LAB_TRAINFREE), "methods", allow_all=True)
    with usage_errors(parser, "--multiples"):
        for m in ns.multiples:
            check_positive_int(m, "multiples")
        check_distinct(ns.multiples, "multiples")
    with usage_errors(parser, "--windows"):
        if check_positive_int(ns.windows, "windows") % BLOCKS:
            raise ValueError(f"windows must be a multiple of {BLOCKS} (the bootstrap blocks), got {ns.windows}")
    with usage_errors(parser, "--passkey-trials"):
        check_positive_int(ns.passkey_trials, "passkey_trials")
    return base, seeds, None if ns.methods == ["all"] else names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = "python -m companion.lab " + " ".join(shlex.quote(a) for a in argv)
    parser = argparse.ArgumentParser(prog="python -m companion.lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="train one scheme and seed, then evaluate it")
    _add_dataclass_options(p_train, TrainConfig)
    _add_dataclass_options(p_train, EvalConfig)
    p_train.add_argument("--checkpoint", default=None,
                         help="where to save (and resume) the checkpoint (default: none, not saved)")
    p_train.add_argument("--out", default=None,
                         help="JSON file for the record and evaluations (default: none, printed only)")
    p_train.add_argument("--no-eval", action="store_true", help="train only, no evaluation (default: evaluate)")
    p_train.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")

    p_eval = sub.add_parser("eval", help="evaluate a saved checkpoint")
    p_eval.add_argument("--checkpoint", required=True, help="a checkpoint written by train or sweep (required)")
    p_eval.add_argument("--out", default=None, help="JSON file for the evaluations (default: none, printed only)")
    p_eval.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    _add_dataclass_options(p_eval, EvalConfig)

    p_sweep = sub.add_parser("sweep", help="train and evaluate several schemes and seeds")
    p_sweep.add_argument("--schemes", nargs="+", default=["all"],
                         help=f"built-in names {list(BUILTIN)}, 'all', or package.module:ClassName (default: all)")
    p_sweep.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of every scheme (default: 0 1)")
    p_sweep.add_argument("--seeds-per-scheme", nargs="+", default=[], metavar="SCHEME=N",
                         help="run SCHEME with seeds 0 .. N-1 instead of --seeds, for example shaw=3 (default: none)")
    p_sweep.add_argument("--workers", type=int, default=2, help="worker processes, one job each (default: 2)")
    p_sweep.add_argument("--checkpoint-dir", default="runs/lab",
                         help="where checkpoints are kept and reused (default: runs/lab)")
    p_sweep.add_argument("--out", default=None, help="JSON file of the sweep (default: none, printed only)")
    _add_quick(p_sweep, QUICK_SWEEP)
    _add_dataclass_options(p_sweep, TrainConfig, skip=("scheme", "seed"))
    _add_dataclass_options(p_sweep, EvalConfig)

    p_ext = sub.add_parser("extend", help="extend a trained RoPE model with each scaling method (chapter 9)")
    p_ext.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                       help="RoPE models of these seeds, trained first if their checkpoint is missing (default: 0 1)")
    p_ext.add_argument("--checkpoint-dir", default="runs/lab",
                       help="where checkpoints are kept and reused (default: runs/lab)")
    p_ext.add_argument("--methods", nargs="+", default=["all"], help=f"{list(METHODS)} or 'all' (default: all)")
    p_ext.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0, 8.0],
                       help="scaling factors s: target lengths s * seq_len (default: 2 4 8)")
    p_ext.add_argument("--finetune-steps", type=int, nargs="+", default=[0, 200],
                       help="fine-tune lengths at the target length, 0 = training-free (default: 0 200)")
    p_ext.add_argument("--finetune-methods", nargs="+", default=None,
                       help="methods fine-tuned at --finetune-steps > 0 (default: --methods)")
    p_ext.add_argument("--finetune-seeds", type=int, nargs="+", default=None,
                       help="seeds whose models get the --finetune-steps jobs (default: --seeds)")
    p_ext.add_argument("--extra-steps", type=int, nargs="+", default=[],
                       help="more fine-tune lengths, run only at --extra-factors for --extra-methods (default: none)")
    p_ext.add_argument("--extra-factors", type=float, nargs="+", default=None,
                       help="factors of the --extra-steps jobs (default: 4)")
    p_ext.add_argument("--extra-methods", nargs="+", default=None,
                       help="methods of the --extra-steps jobs (default: --methods)")
    p_ext.add_argument("--workers", type=int, default=2, help="worker processes, one job each (default: 2)")
    p_ext.add_argument("--out", required=True, help="CSV file of the measurements, with provenance (required)")
    p_ext.add_argument("--json", default=None, help="JSON file for the LongRoPE searches and fine-tune logs (default: none)")
    _add_quick(p_ext, QUICK_EXTEND)
    _add_dataclass_options(p_ext, TrainConfig, skip=("scheme", "seed"))
    _add_dataclass_options(p_ext, ExtendConfig)

    p_tf = sub.add_parser("trainfree", help="training-free extension of the trained RoPE models (chapter 11)")
    p_tf.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                      help="RoPE models of these seeds, trained first if their checkpoint is missing (default: 0 1)")
    p_tf.add_argument("--checkpoint-dir", default="runs/lab",
                      help="where checkpoints are kept and reused (default: runs/lab)")
    p_tf.add_argument("--methods", nargs="+", default=["all"],
                      help="names of companion.lab.trainfree_lab.LAB_TRAINFREE or 'all' (default: all)")
    p_tf.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                      help="evaluation lengths, as multiples of seq_len (default: 1 2 4 8 16)")
    p_tf.add_argument("--windows", type=int, default=2048,
                      help="windows per length, each scoring its last 64 bytes (default: 2048)")
    p_tf.add_argument("--passkey-trials", type=int, default=32,
                      help="retrieval trials per length and key depth, through each method (default: 32)")
    p_tf.add_argument("--workers", type=int, default=2,
                      help="worker processes: checkpoints trained, then evaluated, at once (default: 2)")
    p_tf.add_argument("--out", required=True, help="JSON file of the results, with provenance (required)")
    _add_dataclass_options(p_tf, TrainConfig, skip=("scheme", "seed"))

    ns = parser.parse_args(argv)
    p = {"train": p_train, "eval": p_eval, "sweep": p_sweep, "extend": p_ext, "trainfree": p_tf}[ns.cmd]
    quick = ns.cmd in QUICK and ns.quick
    if quick:
        ns = apply_quick(parser, p, argv, ns, QUICK[ns.cmd])
    _check_common(p, ns)
    if ns.cmd == "train":
        cfg = TrainConfig(**_train_config(p, ns))
        with usage_errors(p, "--scheme"):
            _check_schemes([cfg.scheme], cfg)
        if ns.no_eval and _picked(ns, EvalConfig):
            p.error(f"argument --no-eval: the evaluation options {sorted(_picked(ns, EvalConfig))} would be ignored")
        ev = None if ns.no_eval else _check_eval(p, ns, cfg)
        with usage_errors(p):
            check_file_target(ns.checkpoint, "--checkpoint")
            _check_parent(ns.checkpoint, "--checkpoint")
        torch.set_num_threads(ns.threads)
        corpus = load_corpus()
        model, record = train(cfg, corpus, checkpoint=ns.checkpoint)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            if ev is not None:
                record.update(evaluate_model(model, cfg, ev, corpus))
            if ns.out:
                save_result(ns.out, record, command=command)
            print(f"{cfg.scheme} seed {cfg.seed}: final training loss "
                  f"{record['log'][-1]['loss']:.3f} bits per byte, {record['seconds']:.0f} s")
        if dist.is_initialized():
            dist.destroy_process_group()
    elif ns.cmd == "eval":
        with usage_errors(p):
            check_existing_file(ns.checkpoint, "--checkpoint")
        _check_eval(p, ns, None)
        try:
            model, ckpt = load_checkpoint(ns.checkpoint)
        except Exception as exc:  # not a checkpoint of the lab's trainer: a usage error, not a traceback
            p.error(f"argument --checkpoint: cannot load {ns.checkpoint!r} as a lab checkpoint "
                    f"({type(exc).__name__}: {exc})")
        cfg = TrainConfig.from_dict(ckpt["config"])
        ev = _check_eval(p, ns, cfg)  # the lengths against the checkpoint's seq_len and max_len
        torch.set_num_threads(ns.threads)
        record = {"config": ckpt["config"], "log": ckpt["log"]}
        record.update(evaluate_model(model, cfg, ev))
        if ns.out:
            save_result(ns.out, record, command=command)
        for k, v in record["eval"]["bpb"].items():
            print(f"length {k:>5}: {v['all']:.3f} bits per byte (last 64: {v['tail']:.3f})")
    elif ns.cmd == "trainfree":
        base, seeds, names = _check_trainfree(p, ns)
        from .trainfree_lab import run_trainfree
        configs = [TrainConfig(scheme="rope", seed=seed, **base) for seed in seeds]
        paths = [str(checkpoint_path(ns.checkpoint_dir, c)) for c in configs]
        train_missing(configs, paths, workers=ns.workers)
        result = run_trainfree(paths, ns.multiples, windows_per_length=ns.windows, names=names,
                               passkey_trials=ns.passkey_trials, workers=ns.workers)
        save_result(ns.out, result, command=command)
        print(f"trainfree: {len(paths)} models in {result['wall_seconds']:.0f} s -> {ns.out}")
    elif ns.cmd == "extend":
        c = _check_extend(p, ns)
        configs = [TrainConfig(scheme="rope", seed=seed, **c["base"]) for seed in c["seeds"]]
        paths = [str(checkpoint_path(ns.checkpoint_dir, cfg)) for cfg in configs]
        train_missing(configs, paths, workers=ns.workers)
        result = run_extension(paths, c["methods"], ns.factors, ns.finetune_steps, c["ev"],
                               finetune_methods=ns.finetune_methods,
                               finetune_checkpoints=None if ns.finetune_seeds is None else
                               [path for cfg, path in zip(configs, paths) if cfg.seed in ns.finetune_seeds],
                               extra_steps=ns.extra_steps, extra_factors=c["extra_factors"],
                               extra_methods=ns.extra_methods, workers=ns.workers,
                               cache_dir=str(Path(ns.checkpoint_dir) / "extend"))
        save_rows(ns.out, ns.json, result, CSV_FIELDS, command=command, quick=quick)
        print(f"extend: {len(result['rows'])} rows in {result['wall_seconds']:.0f} s -> {ns.out}")
        if quick:
            print(f"{SMOKE_RUN}: {ns.out} records \"quick\": true in its provenance")
        print(extension_table(result["rows"]))
    else:
        configs, ev = _check_sweep(p, ns)
        if quick:  # saved here, with "quick": true in its data
            result = run_sweep(configs, ev, out=None, workers=ns.workers, checkpoint_dir=ns.checkpoint_dir,
                               command=command)
            del result["provenance"]
            result["quick"] = True
            if ns.out:
                save_result(ns.out, result, command=command)
        else:
            result = run_sweep(configs, ev, out=ns.out, workers=ns.workers,
                               checkpoint_dir=ns.checkpoint_dir, command=command)
        print(f"sweep: {len(configs)} runs in {result['wall_seconds']:.0f} s" + (f" -> {ns.out}" if ns.out else ""))
        if quick:
            print(SMOKE_RUN + (f": {ns.out} records \"quick\": true" if ns.out else ""))
        print(results_table(result))
    return 0


def extension_table(rows: list[dict]) -> str:
    """An extension's tail bits per byte, job by length (the mean of the seeds; ``-`` where a
    job is not evaluated): what ``extend`` prints at its end."""
    cells: dict[tuple[str, float, int], dict[int, list[float]]] = {}
    for r in rows:
        if r["metric"] == "bpb_tail":
            job = (r["method"], float(r["factor"]), int(r["finetune_steps"]))
            cells.setdefault(job, {}).setdefault(int(r["length"]), []).append(float(r["value"]))
    lengths = sorted({w for per in cells.values() for w in per})
    lines = ["tail bits per byte (last 64 positions of each window), mean of the seeds",
             f"{'method':>14} {'s':>4} {'fine-tune':>9}  " + "  ".join(f"{w:>7}" for w in lengths)]
    for (method, factor, steps), per in cells.items():
        values = [f"{sum(per[w]) / len(per[w]):7.3f}" if w in per else f"{'-':>7}" for w in lengths]
        lines.append(f"{method:>14} {factor:>4g} {steps:>9}  " + "  ".join(values))
    return "\n".join(lines)


def results_table(sweep: dict) -> str:
    """The sweep's tail bits per byte, scheme by length (the mean of the seeds, and their
    range where there are several): what a run prints at its end."""
    from .results import Sweep

    sw = Sweep(sweep)
    head = f"{'scheme':>14} {'seeds':>5}  " + "  ".join(f"{f'{m}x':>18}" for m in sw.multiples)
    lines = ["tail bits per byte (last 64 positions of each window), mean of the seeds [min, max]", head]
    for s in sw.schemes:
        c = sw.curve(s, "tail")
        cells = [f"{c[:, i].mean():5.3f}" + (f" [{c[:, i].min():.2f},{c[:, i].max():.2f}]" if len(c) > 1 else "")
                 for i in range(c.shape[1])]
        lines.append(f"{s:>14} {len(c):>5}  " + "  ".join(f"{x:>18}" for x in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
