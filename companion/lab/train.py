"""The lab's trainer: AdamW, warmup and cosine decay, checkpoints, and DistributedDataParallel.

:func:`train` trains a :class:`~companion.model.TinyDecoder` on the byte corpus with one
scheme. It is seeded (the model's initial weights from ``seed``, the batches from
``seed + 1``), so a run is reproducible on one machine and numeric configuration.

**Distributed.** The same function runs unchanged under ``torchrun``: when the environment
has ``WORLD_SIZE > 1`` it joins the process group (``gloo``: the trainer keeps the model and
the batches on the CPU, even where a GPU exists, and NCCL takes only GPU tensors), wraps
the model in :class:`~torch.nn.parallel.DistributedDataParallel`, and each process takes
``batch_size / WORLD_SIZE`` rows of the same global batch (see
:func:`companion.lab.data.sample_batch`). DDP averages the gradients over the processes, and
every process's loss is the mean over its equally many rows, so the update is the one a
single process computes on the whole global batch, up to the order of floating-point sums.
Only rank 0 writes files.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import check_choice, check_file, check_finite_number, check_positive_int
from ..model import TinyDecoder
from ..utils import provenance
from .corpus import Corpus
from .data import sample_batch
from .schemes import _check_scheme_name, build_scheme, layer_plan_for, nope_layers_for, window_for

__all__ = ["TrainConfig", "train", "build_model", "load_checkpoint", "lr_at", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class TrainConfig:
    """Everything that defines a training run (stored in every checkpoint and result).

    The defaults are the chapter's recipe: a 2-layer, width-64, 4-head model (about 115k
    parameters) trained at ``seq_len = 128`` for 1500 steps of 32 windows, at a peak learning
    rate of ``1e-2`` (``1e-3`` leaves models this small stuck near bigram statistics).

    Every field is checked where the config is made. ``scheme`` is a built-in name of
    :data:`~companion.lab.schemes.BUILTIN`, a RoPE base name ``rope-b<base>`` (RoPE at another
    base: the base is part of the scheme name, so it enters the checkpoint name) or
    ``"package.module:ClassName"`` (checked by its form here; the class is imported when the
    model is built).

    Raises:
        TypeError, ValueError: naming the field, what it got and what is allowed.
    """

    scheme: str = "rope"
    seed: int = 0
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 128
    max_len: int = 2048
    batch_size: int = 32
    steps: int = 1500
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    retrieval_fraction: float = 0.5
    retrieval_queries: int = 3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_scheme_name(self.scheme)
        for name in ("d_model", "n_heads", "n_layers", "seq_len", "max_len", "batch_size", "steps"):
            check_positive_int(getattr(self, name), name)
        check_positive_int(self.seed, "seed", 0)
        check_positive_int(self.warmup, "warmup", 0)
        check_positive_int(self.retrieval_queries, "retrieval_queries")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.max_len < self.seq_len:
            raise ValueError(f"max_len ({self.max_len}) must be at least seq_len ({self.seq_len})")
        check_finite_number(self.lr, "lr")
        check_finite_number(self.grad_clip, "grad_clip")
        for name in ("min_lr_ratio", "retrieval_fraction", "weight_decay"):
            value = check_finite_number(getattr(self, name), name, minimum=0)
            if value > 1:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        check_choice(self.dtype, "dtype", tuple(DTYPES))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at ``step`` (0-based): linear warmup over ``warmup`` steps, then cosine
    decay from ``lr`` to ``min_lr_ratio * lr`` at the last step (and after it).

    Raises:
        TypeError: ``step`` not an int, or ``cfg`` not a :class:`TrainConfig`.
        ValueError: ``step`` below 0.
    """
    check_positive_int(step, "step", 0)
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - 1 - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(cfg: TrainConfig) -> TinyDecoder:
    """The seeded model of a config (the same weights on every process)."""
    torch.manual_seed(cfg.seed)
    scheme = build_scheme(cfg.scheme, d_model=cfg.d_model, n_heads=cfg.n_heads,
                          max_len=cfg.max_len, train_len=cfg.seq_len)
    plan = layer_plan_for(cfg.scheme, cfg.n_layers, cfg.seq_len)
    if plan is not None:  # a per-layer position plan (chapter 13's hybrids)
        model = TinyDecoder(256, cfg.d_model, cfg.n_heads, cfg.n_layers, scheme=scheme, layers=plan)
        return model.to(DTYPES[cfg.dtype])
    window, window_layers = window_for(cfg.scheme, cfg.n_layers, cfg.seq_len)
    model = TinyDecoder(256, cfg.d_model, cfg.n_heads, cfg.n_layers, scheme=scheme,
                        nope_layers=nope_layers_for(cfg.scheme, cfg.n_layers), window=window,
                        window_layers=window_layers)
    return model.to(DTYPES[cfg.dtype])


def project_parameters(model: torch.nn.Module) -> None:
    """Call ``project_()`` on every submodule that has one, after an optimiser step.

    A scheme with constrained parameters (Kerple's positive ``r1, r2``) projects them back into
    their bounds in place, as its reference implementation does, so that a parameter that
    stepped past a bound sits on it and can move back, instead of staying past it where the
    forward pass's clamp gives it no gradient.
    """
    for module in model.modules():
        project = getattr(module, "project_", None)
        if callable(project):
            project()


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not on biases, gains, slopes or single scalars).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _distributed() -> tuple[int, int]:
    """Join the process group if launched by torchrun; return ``(rank, world_size)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        # gloo, also on machines with a GPU: the model and batches stay on the CPU here, and
        # NCCL refuses CPU tensors (DDP's first broadcast would fail).
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _save(path: Path, model: TinyDecoder, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int,
          log: list[dict[str, float]], info: dict[str, Any], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"config": asdict(cfg), "step": step, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "log": log, "info": info, "seconds": seconds}, tmp)
    os.replace(tmp, path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[TinyDecoder, dict[str, Any]]:
    """Load a checkpoint written by :func:`train` (``weights_only=True``: no code is run).

    Returns the model, in eval mode, and the checkpoint dict (``config``, ``step``, ``log``,
    ``info``, ``optimizer``).

    Raises:
        FileNotFoundError, IsADirectoryError: ``path`` is missing or a folder.
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        ValueError: the file is not a checkpoint written by :func:`train` (not a torch file,
            no ``config`` or ``model``, or weights that do not fit the config's model).
    """
    p = check_file(path, "path", "a checkpoint written by companion.lab.train")
    what = f"path {str(p)!r} is not a checkpoint written by companion.lab.train"
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError) as exc:
        detail = "" if isinstance(exc, pickle.UnpicklingError) else f": {_first_line(exc)}"  # torch's text
        # there suggests weights_only=False, which would run the file's code: not the fix here
        raise ValueError(f"{what}: torch.load cannot read it as a checkpoint of tensors and plain data "
                         f"({type(exc).__name__}{detail})") from exc
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("config"), dict) or "model" not in ckpt:
        keys = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{what}: expected a dict with 'config' and 'model', got {keys}")
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: its config is invalid ({exc})") from exc
    model = build_model(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ValueError(f"{what}: its weights do not fit the model of its config "
                         f"({type(exc).__name__}: {_first_line(exc)})") from exc
    return model.eval(), ckpt


def train(
    cfg: TrainConfig,
    corpus: Corpus,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    log_every: int = 50,
    progress: bool = True,
) -> tuple[TinyDecoder, dict[str, Any]]:
    """Train one model; return it (unwrapped, in eval mode) and a record of the run.

    Args:
        cfg: the run.
        corpus: the bytes to train on (``corpus.train``).
        checkpoint: where rank 0 saves the final checkpoint (``torch.save``; load it with
            :func:`load_checkpoint`). If the file exists and holds the same config, training
            resumes from it.
        log_every: record the training loss every this many steps (and at the last).
        progress: show a tqdm progress bar on rank 0.

    Returns:
        ``(model, record)``; ``record`` has ``config``, ``log`` (``step``, ``lr``, ``loss``
        in bits per byte), ``parameters``, ``seconds`` (training time, including the time
        a resumed checkpoint had already spent), ``world_size``, ``tokens_per_second`` and
        ``provenance``.
    """
    rank, world = _distributed()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of WORLD_SIZE ({world})")
    model = build_model(cfg)
    opt = _optimizer(model, cfg)
    log: list[dict[str, float]] = []
    start_step, prior_seconds = 0, 0.0
    path = None if checkpoint is None else Path(checkpoint)
    if path is not None and path.exists():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if ckpt["config"] == asdict(cfg):
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            start_step, log = int(ckpt["step"]), list(ckpt["log"])
            prior_seconds = float(ckpt.get("seconds", 0.0))
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(start_step):  # replay the data stream up to the resumed step
        sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen,
                     retrieval_fraction=cfg.retrieval_fraction,
                     retrieval_queries=cfg.retrieval_queries, rank=rank, world_size=world)
    bar = None
    if progress and rank == 0 and start_step < cfg.steps:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.scheme, leave=False)
    model.train()
    t0 = time.perf_counter()
    for step in range(start_step, cfg.steps):
        x, y = sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen,
                            retrieval_fraction=cfg.retrieval_fraction,
                            retrieval_queries=cfg.retrieval_queries, rank=rank, world_size=world)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = net(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        project_parameters(model)
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            value = loss.detach()
            if world > 1:
                dist.all_reduce(value)
                value = value / world
            log.append({"step": step + 1, "lr": lr_at(step, cfg), "loss": float(value) / math.log(2)})
            if bar is not None:
                bar.set_postfix(bpb=f"{log[-1]['loss']:.3f}")
        if bar is not None:
            bar.update(1)
    new_seconds = time.perf_counter() - t0
    seconds = prior_seconds + new_seconds
    if bar is not None:
        bar.close()
    record = {
        "config": asdict(cfg),
        "log": log,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "world_size": world,
        "tokens_per_second": cfg.steps * cfg.batch_size * cfg.seq_len / max(seconds, 1e-9),
        "provenance": {**provenance(), "corpus": corpus.info},
    }
    if path is not None and rank == 0:
        _save(path, model, opt, cfg, cfg.steps, log, {"corpus": corpus.info}, seconds)
    if world > 1:
        dist.barrier()
    return model.eval(), record
