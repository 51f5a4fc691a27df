"""companion: tested implementations of Transformer position encodings.

The companion package of the book *Positional Encoding in Transformers*. Every scheme is a
:class:`~companion.attention.PositionScheme` that implements some of four hooks (``embed``,
``rotate``, ``bias``, ``score``); :func:`~companion.attention.attention` is the reference
attention that honours them all.
"""

from .attention import HOOKS, NoPE, PositionScheme, attention, causal_mask
from .model import MultiHeadAttention, TinyDecoder
from .utils import load_result, provenance, save_result, seed_everything

__version__ = "0.1.0"

__all__ = [
    "HOOKS",
    "MultiHeadAttention",
    "NoPE",
    "PositionScheme",
    "TinyDecoder",
    "attention",
    "causal_mask",
    "load_result",
    "provenance",
    "save_result",
    "seed_everything",
]
