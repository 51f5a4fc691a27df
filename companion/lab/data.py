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

__all__ = ["KEY_OPEN", "KEY_CLOSE", "KEY_DIGITS", "QUERY_LEN", "random_digits", "write_key",
           "sample_batch", "windows"]

#: The control bytes around a key (STX, ETX); neither occurs in the standard library's source.
KEY_OPEN, KEY_CLOSE = 0x02, 0x03
#: Digits per key.
KEY_DIGITS = 5
#: Bytes of a key (``KEY_OPEN``, the digits, ``KEY_CLOSE``) and of a query (no ``KEY_CLOSE``).
KEY_LEN, QUERY_LEN = KEY_DIGITS + 2, KEY_DIGITS + 1
_DIGIT0 = ord("0")


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
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """One training batch ``(inputs, targets)``, each ``(batch_size // world_size, seq_len)``.

    Draws the whole global batch of ``batch_size`` windows of ``seq_len + 1`` bytes (uniform
    start positions), writes a key and a later query into each row with probability
    ``retrieval_fraction``, and returns the rows ``rank::world_size`` of it (so every
    process draws the same random numbers and the processes' rows partition the batch).
    """
    if batch_size % world_size:
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of world_size ({world_size})")
    if seq_len < 2 * KEY_LEN and retrieval_fraction > 0:
        raise ValueError(f"seq_len must be at least {2 * KEY_LEN} for the retrieval mix, got {seq_len}")
    n = data.size - seq_len - 1
    if n <= 0:
        raise ValueError(f"the data ({data.size} bytes) is shorter than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, n, (batch_size,), generator=generator)
    rows = windows(data, starts, seq_len + 1)
    if retrieval_fraction > 0:
        chosen = torch.rand(batch_size, generator=generator) < retrieval_fraction
        digits = random_digits(batch_size, generator)
        # key at k in [0, seq_len + 1 - KEY_LEN - QUERY_LEN], query at q in [k + KEY_LEN, end]
        u = torch.rand(batch_size, 2, generator=generator)
        last = seq_len + 1 - QUERY_LEN
        for i in torch.nonzero(chosen).flatten().tolist():
            k = int(u[i, 0] * (last - KEY_LEN + 1))
            q = k + KEY_LEN + int(u[i, 1] * (last - k - KEY_LEN + 1))
            write_key(rows[i], k, digits[i])
            write_key(rows[i], q, digits[i], close=False)
    rows = rows[rank::world_size]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
