"""Fused GPU kernels for position encoding, in Triton, with one entry point per operation.

* :func:`fused_rope`: RoPE of queries and keys in one launch, equal to
  :func:`companion.rope.apply_rope` (bit for bit in float32).
* :func:`flash_attention_with_bias`: FlashAttention-style attention with an ALiBi or T5
  position bias computed inside the kernel, never materialised.

The backend follows the tensors' device (see :func:`kernel_backend`): CUDA runs
the Triton kernels; CPU runs them through Triton's interpreter when ``TRITON_INTERPRET=1``
was set before the kernels were first used, and the torch references otherwise.
``import companion.kernels`` does not import Triton, and works without it installed.
"""

from .api import (
    BIASES,
    KERNEL_DTYPES,
    MAX_ATTENTION_HEAD_DIM,
    MAX_ROPE_HEAD_DIM,
    flash_attention_with_bias,
    fused_rope,
    kernel_backend,
)

__all__ = [
    "BIASES",
    "KERNEL_DTYPES",
    "MAX_ATTENTION_HEAD_DIM",
    "MAX_ROPE_HEAD_DIM",
    "flash_attention_with_bias",
    "fused_rope",
    "kernel_backend",
]
