"""A user's own position scheme, as a researcher would write it, for the lab's tests.

``tests/test_lab.py`` loads these classes through ``companion.lab``'s "bring your own
scheme" path (``--scheme lab_user_scheme:LongBaseRotary``), the same way a user's
``mypkg.enc:MyScheme`` is loaded: by import path, with only the constructor arguments the
class names. Nothing here is part of the package.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.attention import PositionScheme
from companion.rope import rope_cos_sin, rope_frequencies


def _turn(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate the pairs ``(x[i], x[i + d/2])`` of ``x`` by ``pos * inv_freq[i]``."""
    work = torch.promote_types(x.dtype, torch.float32)
    cos, sin = rope_cos_sin(pos, inv_freq)
    cos, sin = cos.to(work), sin.to(work)
    if cos.dim() == 3:  # per-row positions (batch, seq, d/2): broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    a, b = x.to(work).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class LongBaseRotary(PositionScheme):
    """A rotary scheme whose base grows with the longest evaluated length.

    ``base = base_factor * max_len``, so the slowest pair turns by well under one radian
    over any evaluated sequence. The constructor records the arguments it was given in
    :attr:`received`, so a test can check what the lab passed.

    Args:
        head_dim: the per-head width (even).
        max_len: the longest sequence the experiment evaluates.
        base_factor: the base as a multiple of ``max_len`` (the lab never passes it).
    """

    def __init__(self, head_dim: int, max_len: int, *, base_factor: float = 10.0) -> None:
        super().__init__()
        self.received = {"head_dim": head_dim, "max_len": max_len, "base_factor": base_factor}
        self.register_buffer("inv_freq", rope_frequencies(head_dim, base=base_factor * max_len),
                             persistent=False)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return _turn(q, q_pos, self.inv_freq), _turn(k, k_pos, self.inv_freq)


class NeedsWidth(PositionScheme):
    """A scheme whose constructor needs an argument the lab does not provide (``width``)."""

    def __init__(self, head_dim: int, width: int) -> None:
        super().__init__()
        self.width = width


class NotAScheme(torch.nn.Module):
    """A module that is not a :class:`~companion.attention.PositionScheme`."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
