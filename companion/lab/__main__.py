"""``python -m companion.lab train|eval|sweep|extend|trainfree ...``: the lab's command line.

Examples::

    # one scheme, one seed: train, save a checkpoint, evaluate, write JSON
    python -m companion.lab train --scheme rope --seed 0 --checkpoint runs/rope.pt --out rope.json
    # evaluate a saved checkpoint again
    python -m companion.lab eval --checkpoint runs/rope.pt --out rope-eval.json
    # chapter 8's sweep: eight schemes, five seeds (three for three of them), two worker processes
    python -m companion.lab sweep --schemes xl shaw nope learned sinusoidal t5 rope alibi --seeds 0 1 2 3 4 \
        --seeds-per-scheme shaw=3 learned=3 sinusoidal=3 --workers 2 --out chapters/data/08_sweep.json
    # chapter 9: every RoPE scaling method at 2x, 4x, 8x, without and with a short fine-tune
    python -m companion.lab extend --seeds 0 1 --factors 2 4 8 --finetune-steps 0 200 \
        --out chapters/data/09_extension.csv --json chapters/data/09_extension.json
    # chapter 11: training-free extension (ReRoPE, Self-Extend, attention sinks) of the RoPE models
    python -m companion.lab trainfree --seeds 0 1 --out chapters/data/11_trainfree_lab.json
    # your own encoding beside the baselines
    python -m companion.lab sweep --schemes nope rope alibi mypkg.enc:MyScheme --seeds 0 1 --out mine.json

Every field of :class:`~companion.lab.train.TrainConfig` is an option (``--steps 500``,
``--seq-len 64``, ...). ``train`` runs under ``torchrun`` too (DistributedDataParallel)::

    torchrun --nproc-per-node 2 -m companion.lab train --scheme rope --checkpoint runs/rope.pt
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import torch

import torch.distributed as dist

from ..utils import save_csv, save_result
from .corpus import load_corpus
from .extend import CSV_FIELDS, METHODS, ExtendConfig, run_extension, train_missing
from .schemes import BUILTIN
from .sweep import EvalConfig, checkpoint_path, evaluate_model, run_sweep
from .train import TrainConfig, load_checkpoint, train


def _add_dataclass_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    for f in fields(cls):
        if f.name in skip:
            continue
        default = getattr(cls(), f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, list):
            kind = type(default[0]) if default else int
            parser.add_argument(flag, type=kind, nargs="+", default=None, help=f"default {default}")
        else:
            parser.add_argument(flag, type=type(default), default=None, help=f"default {default!r}")


def _picked(ns: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict:
    return {f.name: getattr(ns, f.name) for f in fields(cls)
            if f.name not in skip and getattr(ns, f.name, None) is not None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = "python -m companion.lab " + " ".join(shlex.quote(a) for a in argv)
    parser = argparse.ArgumentParser(prog="python -m companion.lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p_train = sub.add_parser("train", help="train one scheme and seed, then evaluate it")
    _add_dataclass_options(p_train, TrainConfig)
    _add_dataclass_options(p_train, EvalConfig)
    p_train.add_argument("--checkpoint", default=None, help="where to save (and resume) the checkpoint")
    p_train.add_argument("--out", default=None, help="JSON file for the record and evaluations")
    p_train.add_argument("--no-eval", action="store_true", help="train only")
    p_train.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")

    p_eval = sub.add_parser("eval", help="evaluate a saved checkpoint")
    p_eval.add_argument("--checkpoint", required=True)
    p_eval.add_argument("--out", default=None)
    p_eval.add_argument("--threads", type=int, default=1)
    _add_dataclass_options(p_eval, EvalConfig)

    p_sweep = sub.add_parser("sweep", help="train and evaluate several schemes and seeds")
    p_sweep.add_argument("--schemes", nargs="+", default=["all"],
                         help=f"built-in names {list(BUILTIN)}, 'all', or package.module:ClassName")
    p_sweep.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p_sweep.add_argument("--seeds-per-scheme", nargs="+", default=[], metavar="SCHEME=N",
                         help="run SCHEME with seeds 0 .. N-1 instead of --seeds (for example shaw=3)")
    p_sweep.add_argument("--workers", type=int, default=2)
    p_sweep.add_argument("--checkpoint-dir", default="runs/lab")
    p_sweep.add_argument("--out", default=None)
    _add_dataclass_options(p_sweep, TrainConfig, skip=("scheme", "seed"))
    _add_dataclass_options(p_sweep, EvalConfig)

    p_ext = sub.add_parser("extend", help="extend a trained RoPE model with each scaling method (chapter 9)")
    p_ext.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                       help="RoPE models of these seeds (trained first if their checkpoint is missing)")
    p_ext.add_argument("--checkpoint-dir", default="runs/lab")
    p_ext.add_argument("--methods", nargs="+", default=["all"], help=f"{list(METHODS)} or 'all'")
    p_ext.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p_ext.add_argument("--finetune-steps", type=int, nargs="+", default=[0, 200])
    p_ext.add_argument("--finetune-methods", nargs="+", default=None,
                       help="methods fine-tuned at --finetune-steps > 0 (default: --methods)")
    p_ext.add_argument("--finetune-seeds", type=int, nargs="+", default=None,
                       help="seeds whose models get the --finetune-steps jobs (default: --seeds)")
    p_ext.add_argument("--extra-steps", type=int, nargs="+", default=[],
                       help="more fine-tune lengths, run only at --extra-factors for --extra-methods")
    p_ext.add_argument("--extra-factors", type=float, nargs="+", default=[4.0])
    p_ext.add_argument("--extra-methods", nargs="+", default=None, help="default: --methods")
    p_ext.add_argument("--workers", type=int, default=2)
    p_ext.add_argument("--out", required=True, help="CSV file of the measurements (with provenance)")
    p_ext.add_argument("--json", default=None, help="JSON file for the LongRoPE searches and fine-tune logs")
    _add_dataclass_options(p_ext, TrainConfig, skip=("scheme", "seed"))
    _add_dataclass_options(p_ext, ExtendConfig)

    p_tf = sub.add_parser("trainfree", help="training-free extension of the trained RoPE models (chapter 11)")
    p_tf.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                      help="RoPE models of these seeds (trained first if their checkpoint is missing)")
    p_tf.add_argument("--checkpoint-dir", default="runs/lab")
    p_tf.add_argument("--methods", nargs="+", default=["all"], help="names of companion.lab.trainfree_lab.LAB_TRAINFREE or 'all'")
    p_tf.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p_tf.add_argument("--windows", type=int, default=2048, help="windows per length (each scores its last 64 bytes)")
    p_tf.add_argument("--workers", type=int, default=2)
    p_tf.add_argument("--out", required=True, help="JSON file of the results (with provenance)")
    _add_dataclass_options(p_tf, TrainConfig, skip=("scheme", "seed"))

    ns = parser.parse_args(argv)
    if ns.cmd in ("train", "eval"):
        torch.set_num_threads(ns.threads)
    if ns.cmd == "train":
        cfg = TrainConfig(**_picked(ns, TrainConfig))
        corpus = load_corpus()
        model, record = train(cfg, corpus, checkpoint=ns.checkpoint)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            if not ns.no_eval:
                record.update(evaluate_model(model, cfg, EvalConfig(**_picked(ns, EvalConfig)), corpus))
            if ns.out:
                save_result(ns.out, record, command=command)
            print(f"{cfg.scheme} seed {cfg.seed}: final training loss "
                  f"{record['log'][-1]['loss']:.3f} bits per byte, {record['seconds']:.0f} s")
        if dist.is_initialized():
            dist.destroy_process_group()
    elif ns.cmd == "eval":
        model, ckpt = load_checkpoint(ns.checkpoint)
        cfg = TrainConfig.from_dict(ckpt["config"])
        record = {"config": ckpt["config"], "log": ckpt["log"]}
        record.update(evaluate_model(model, cfg, EvalConfig(**_picked(ns, EvalConfig))))
        if ns.out:
            save_result(ns.out, record, command=command)
        for k, v in record["eval"]["bpb"].items():
            print(f"length {k:>5}: {v['all']:.3f} bits per byte (last 64: {v['tail']:.3f})")
    elif ns.cmd == "trainfree":
        from .trainfree_lab import run_trainfree
        base = _picked(ns, TrainConfig, skip=("scheme", "seed"))
        configs = [TrainConfig(scheme="rope", seed=seed, **base) for seed in ns.seeds]
        paths = [str(checkpoint_path(ns.checkpoint_dir, c)) for c in configs]
        train_missing(configs, paths, workers=ns.workers)
        result = run_trainfree(paths, ns.multiples, windows_per_length=ns.windows,
                               names=None if ns.methods == ["all"] else ns.methods)
        save_result(ns.out, result, command=command)
        print(f"trainfree: {len(paths)} models in {result['wall_seconds']:.0f} s -> {ns.out}")
    elif ns.cmd == "extend":
        base = _picked(ns, TrainConfig, skip=("scheme", "seed"))
        configs = [TrainConfig(scheme="rope", seed=seed, **base) for seed in ns.seeds]
        paths = [str(checkpoint_path(ns.checkpoint_dir, c)) for c in configs]
        train_missing(configs, paths, workers=ns.workers)
        methods = list(METHODS) if ns.methods == ["all"] else ns.methods
        result = run_extension(paths, methods, ns.factors, ns.finetune_steps,
                               ExtendConfig(**_picked(ns, ExtendConfig)), finetune_methods=ns.finetune_methods,
                               finetune_checkpoints=None if ns.finetune_seeds is None else
                               [p for c, p in zip(configs, paths) if c.seed in ns.finetune_seeds],
                               extra_steps=ns.extra_steps, extra_factors=ns.extra_factors,
                               extra_methods=ns.extra_methods, workers=ns.workers,
                               cache_dir=str(Path(ns.checkpoint_dir) / "extend"))
        save_csv(ns.out, result["rows"], CSV_FIELDS, command=command)
        if ns.json:
            save_result(ns.json, {k: v for k, v in result.items() if k != "rows"}, command=command)
        print(f"extend: {len(result['rows'])} rows in {result['wall_seconds']:.0f} s -> {ns.out}")
    else:
        schemes = list(BUILTIN) if ns.schemes == ["all"] else ns.schemes
        base = _picked(ns, TrainConfig, skip=("scheme", "seed"))
        seeds = {s: list(ns.seeds) for s in schemes}
        for item in ns.seeds_per_scheme:
            name, _, count = item.partition("=")
            if name not in seeds or not count.isdigit() or int(count) < 1:
                parser.error(f"--seeds-per-scheme takes SCHEME=N with SCHEME among --schemes {schemes} and N >= 1, "
                             f"got {item!r}")
            seeds[name] = list(range(int(count)))
        configs = [TrainConfig(scheme=s, seed=seed, **base) for s in schemes for seed in seeds[s]]
        result = run_sweep(configs, EvalConfig(**_picked(ns, EvalConfig)), out=ns.out, workers=ns.workers,
                           checkpoint_dir=ns.checkpoint_dir, command=command)
        print(f"sweep: {len(configs)} runs in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
