"""Batches for the lab: random byte windows, with an optional synthetic retrieval mix.

A plain byte-level model trained on code this small does not retrieve a passkey at all (it
has never been asked to), so the lab can mix a small synthetic retrieval task into training:
in a fraction of the windows a *key* ``KEY_OPEN d1 d2 d3 d4 d5 KEY_CLOSE`` (five random
digits between two control bytes that never occur in the corpus) is written at a random
place, and later in the same window a *query* ``KEY_OPEN d1 .. d5`` repeats it. Predicting
the query's digits is easy only for a model that finds the key and copies it; every other
byte of the window is ordinary code. :mod:`companion.lab.evaluate` measures how far the
copying reaches.

All randomness comes from one ``torch.Generator`` and the *global* batch is drawn in full
on every process, each taking its own rows, so a run with ``W`` processes sees exactly the
data of a run with one process and the same global batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .._checks import check_positive_int

__all__ = ["KEY_OPEN", "KEY_CLOSE", "KEY_DIGITS", "QUERY_LEN", "as_generator", "random_digits", "write_key",
           "sample_batch", "windows"]

#: The control bytes around a key (STX, ETX); neither occurs in the standard library's source.
KEY_OPEN, KEY_CLOSE = 0x02, 0x03
#: Digits per key.
KEY_DIGITS = 5
#: Bytes of a key (``KEY_OPEN``, the digits, ``KEY_CLOSE``) and of a query (no ``KEY_CLOSE``).
KEY_LEN, QUERY_LEN = KEY_DIGITS + 2, KEY_DIGITS + 1
_DIGIT0 = ord("0")


def as_generator(generator: torch.Generator | int) -> torch.Generator:
    """``generator`` itself, or a fresh CPU generator seeded with the int ``generator`` (>= 0).
    torch's CPU generator is portable: the same seed draws the same numbers on every machine."""
    if isinstance(generator, torch.Generator):
        return generator
    check_positive_int(generator, "generator", 0)
    return torch.Generator().manual_seed(generator)


def random_digits(n: int, generator: torch.Generator) -> Tensor:
    """``(n, KEY_DIGITS)`` ASCII digit bytes (int64)."""
    return torch.randint(0, 10, (n, KEY_DIGITS), generator=generator) + _DIGIT0


def write_key(row: Tensor, at: int, digits: Tensor, *, close: bool = True) -> None:
    """Write ``KEY_OPEN digits [KEY_CLOSE]`` into ``row`` in place, starting at index ``at``."""
    row[at] = KEY_OPEN
    row[at + 1: at + 1 + KEY_DIGITS] = digits
    if close:
        row[at + 1 + KEY_DIGITS] = KEY_CLOSE


def windows(data: np.ndarray, starts: Tensor, length: int) -> Tensor:
    """Rows ``data[s : s + length]`` for each start, as an int64 ``(len(starts), length)``."""
    idx = starts[:, None].numpy() + np.arange(length)[None, :]
    return torch.from_numpy(data[idx].astype(np.int64))


def sample_batch(
    data: np.ndarray,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    *,
    retrieval_fraction: float = 0.0,
    retrieval_queries: int = 1,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """One training batch ``(inputs, targets)``, each ``(batch_size // world_size, seq_len)``.

    Draws the whole global batch of ``batch_size`` windows of ``seq_len + 1`` bytes (uniform
    start positions), writes a key and ``retrieval_queries`` later queries of it into each
    row with probability ``retrieval_fraction``, and returns the rows ``rank::world_size`` of
    it (so every process draws the same random numbers and the processes' rows partition the
    batch). The key and the queries never overlap: their start positions are drawn as sorted
    uniform positions in the free space, then spread apart by the sizes of what precedes.

    Raises:
        TypeError: a size or ``rank`` that is not an int.
        ValueError: a ``batch_size``, ``seq_len`` or ``world_size`` below 1, a ``rank``
            outside ``[0, world_size)``, a ``batch_size`` that is not a multiple of
            ``world_size``, data of at most ``seq_len + 1`` bytes, or a ``seq_len`` too short
            for a key and its queries when
            ``retrieval_fraction > 0``, or ``retrieval_queries < 1``.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        check_positive_int(value, name)
    check_positive_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    if batch_size % world_size:
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of world_size ({world_size})")
    check_positive_int(retrieval_queries, "retrieval_queries")
    need = KEY_LEN + retrieval_queries * QUERY_LEN
    if seq_len + 1 < need and retrieval_fraction > 0:
        raise ValueError(
            f"seq_len must be at least {need - 1} for a key and {retrieval_queries} queries "
            f"(retrieval_fraction > 0), got {seq_len}"
        )
    n = data.size - seq_len - 1
    if n <= 0:
        raise ValueError(f"the data ({data.size} bytes) must be longer than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, n, (batch_size,), generator=generator)
    rows = windows(data, starts, seq_len + 1)
    if retrieval_fraction > 0:
        chosen = torch.rand(batch_size, generator=generator) < retrieval_fraction
        digits = random_digits(batch_size, generator)
        free = seq_len + 1 - need  # bytes of text left around the key and the queries
        u = torch.rand(batch_size, 1 + retrieval_queries, generator=generator)
        sizes = torch.tensor([0, KEY_LEN] + [QUERY_LEN] * (retrieval_queries - 1))
        for i in torch.nonzero(chosen).flatten().tolist():
            offsets = (u[i] * (free + 1)).long().clamp_max(free).sort().values + sizes.cumsum(0)
            write_key(rows[i], int(offsets[0]), digits[i])
            for at in offsets[1:].tolist():
                write_key(rows[i], at, digits[i], close=False)
    rows = rows[rank::world_size]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
