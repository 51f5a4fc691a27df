"""The experiment engine: train short, test long, for every position scheme.

``companion.lab`` trains :class:`~companion.model.TinyDecoder` on the bytes of the Python
standard library's source (:mod:`~companion.lab.corpus`) with any scheme, built-in or your own
(:mod:`~companion.lab.schemes`), and measures what happens past the training length
(:mod:`~companion.lab.evaluate`): bits per byte from 1x to 16x the training length,
non-overlapping and sliding, passkey retrieval, and attention entropy. The trainer
(:mod:`~companion.lab.train`) is AdamW with warmup and cosine decay, and runs unchanged under
``torchrun`` with DistributedDataParallel. :mod:`~companion.lab.sweep` runs many jobs in
parallel processes; ``python -m companion.lab train|eval|sweep`` is the command line.

Chapter 8 of the book is built on it.
"""

from .corpus import Corpus, load_corpus
from .evaluate import attention_entropy, bits_per_byte, passkey_retrieval, sliding_bits_per_byte
from .schemes import BUILTIN, build_scheme, scheme_label
from .sweep import EvalConfig, evaluate_model, run_job, run_sweep
from .train import TrainConfig, build_model, load_checkpoint, lr_at, train

__all__ = [
    "BUILTIN",
    "Corpus",
    "EvalConfig",
    "TrainConfig",
    "attention_entropy",
    "bits_per_byte",
    "build_model",
    "build_scheme",
    "evaluate_model",
    "load_checkpoint",
    "load_corpus",
    "lr_at",
    "passkey_retrieval",
    "run_job",
    "run_sweep",
    "scheme_label",
    "sliding_bits_per_byte",
    "train",
]
