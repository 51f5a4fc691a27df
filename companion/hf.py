"""The HuggingFace transformers integration: the package's RoPE and attention inside a transformers model.

HuggingFace transformers (:cite:`wolf2020transformers`) is optional: ``pip install
'pe-companion[hf]'`` installs the version this module is tested with, 5.24.0; importing the
module needs it. Three pieces, each a one-line change to a transformers model:

* :func:`rotary_embedding` builds, from a model config, a module with the call signature and
  the return value of transformers' rotary embeddings (``LlamaRotaryEmbedding`` and its
  copies): ``(x, position_ids) -> (cos, sin)``, full-width tables in the half-split layout,
  in ``x``'s dtype. The frequencies come from :mod:`companion.scaling` (every HuggingFace
  ``rope_type``, the v5 ``rope_parameters`` or the legacy ``rope_scaling`` plus
  ``rope_theta``), the angles and tables are computed in float32, with transformers' own
  operations, so swapping it in leaves a float32 model's logits bit for bit unchanged::

      model.model.rotary_emb = companion.hf.rotary_embedding(model.config)

* Importing this module registers :func:`attention_forward` with transformers'
  ``AttentionInterface`` under the name :data:`ATTENTION_NAME` (``"companion"``), together
  with a mask function in ``AttentionMaskInterface``, so that ::

      AutoModelForCausalLM.from_pretrained(..., attn_implementation="companion")
      model.set_attn_implementation("companion")   # or on a loaded model

  run every attention layer through :func:`companion.dispatch.fast_attention`. The mask
  function matters: transformers builds no mask for an attention implementation that has
  none registered and passes ``attention_mask=None``, which silently lets the padding of a
  padded batch into every row. :func:`register` registers both under another name.

* :func:`use_scheme` gives the attention layers a position-bias scheme (ALiBi, T5's buckets,
  Kerple), added to the logits by the package's attention; ``rope=False`` also turns the
  model's own RoPE into the identity, which makes, for example, an ALiBi Llama.

What differs from transformers on purpose: the rotary module refuses positions at or past
``2**24`` (float32 holds every integer only up to there) and a nested per-layer
``rope_parameters`` dict; the attention refuses dropout, soft-capping and attention sinks
(:func:`~companion.dispatch.fast_attention` has none of them) and returns no weights (as
transformers' ``"sdpa"`` does not).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "companion.hf needs HuggingFace transformers: pip install 'pe-companion[hf]' "
        "(transformers==5.24.0, the version its tests use)"
    ) from exc

from ._checks import check_float_tensor, check_int_tensor
from .attention import PositionScheme
from .dispatch import fast_attention
from .rope import _FP32_EXACT_INT, RotaryEmbedding, rope_cos_sin
from .scaling import rope_parameters_from_legacy

__all__ = [
    "ATTENTION_NAME",
    "SCHEME_ATTRIBUTE",
    "HFRotaryEmbedding",
    "rotary_embedding",
    "rope_config_of",
    "attention_forward",
    "register",
    "use_scheme",
]

#: The name under which importing :mod:`companion.hf` registers the package's attention:
#: ``attn_implementation="companion"``.
ATTENTION_NAME = "companion"

#: The module attribute :func:`use_scheme` sets on each attention layer, read by
#: :func:`attention_forward`.
SCHEME_ATTRIBUTE = "companion_scheme"


# ----------------------------------------------------------------------------- configs


def _get(config: object, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict (a ``config.json``), ``config.key`` for a config object."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def rope_config_of(config: object) -> tuple[dict[str, Any], int, int | None]:
    """The RoPE of a transformers model config: ``(rope_parameters, head_dim, max_position_embeddings)``.

    ``config`` is a transformers ``PreTrainedConfig`` (``model.config``) or the dict of a
    ``config.json``. The v5 ``rope_parameters`` dict is used as it is (transformers has already
    put ``rope_theta`` and ``partial_rotary_factor`` in it); a config with the legacy
    ``rope_scaling`` instead goes through
    :func:`companion.scaling.rope_parameters_from_legacy` with its ``rope_theta``, and a
    top-level ``partial_rotary_factor`` or (for ``llama3``, ``yarn`` and ``longrope``)
    ``original_max_position_embeddings`` moves into the dict, as transformers' own conversion
    does. ``head_dim`` is ``config.head_dim``, or ``hidden_size // num_attention_heads``.

    Args:
        config: the model config.

    Returns:
        A new dict (the config is not modified), the head dimension, and
        ``max_position_embeddings`` (``None`` if the config has none).

    Raises:
        TypeError: ``config`` is neither a dict nor an object with config attributes, or a
            field has the wrong type.
        ValueError: the config has no RoPE fields at all (neither ``rope_parameters`` nor
            ``rope_scaling`` nor ``rope_theta``), no ``rope_theta`` (in the dict or beside it), a
            ``rope_parameters`` nested by layer type, or no head dimension.
    """
    if config is None or isinstance(config, (str, bytes, int, float, Tensor)):
        raise TypeError(
            f"config must be a transformers config (model.config) or a config.json dict, got {type(config).__name__}"
        )
    params = _get(config, "rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"config.rope_parameters must be a dict, got {type(params).__name__}")
    if params:  # v5
        if "rope_type" not in params and "type" not in params and any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(
                f"config.rope_parameters is nested by layer type ({sorted(params)}); rotary_embedding supports "
                f"one global RoPE dict (the Llama family): pass the dict of one layer type, "
                f"rotary_embedding({{**config.to_dict(), 'rope_parameters': config.rope_parameters['<layer type>']}})"
            )
        params = copy.deepcopy(dict(params))
        if "rope_theta" not in params and _get(config, "rope_theta") is not None:
            params["rope_theta"] = _get(config, "rope_theta")
        if "rope_theta" not in params:
            raise ValueError(
                "config.rope_parameters has no 'rope_theta' (the RoPE base) and the config has none beside it; "
                "a default base (10000) would give a Llama 3.1 config (base 500000) wrong frequencies. A dict "
                "without its base is usually an old rope_scaling dict: convert it with "
                "companion.scaling.rope_parameters_from_legacy(config['rope_scaling'], config['rope_theta']), or "
                "put the model's 'rope_theta' in the dict"
            )
    else:  # legacy: rope_scaling beside rope_theta
        scaling, theta = _get(config, "rope_scaling"), _get(config, "rope_theta")
        if scaling is None and theta is None:
            raise ValueError(
                "config has no RoPE fields: neither rope_parameters (transformers v5) nor rope_scaling and "
                "rope_theta (older configs); pass the config of a RoPE model"
            )
        if theta is None and not (isinstance(scaling, Mapping) and "rope_theta" in scaling):
            raise ValueError(
                "config has rope_scaling but no rope_theta (the RoPE base); give the config its model's "
                "rope_theta (transformers' default for the model class, often 10000.0) rather than letting a "
                "default pick a base"
            )
        params = rope_parameters_from_legacy(scaling, theta)
    if "partial_rotary_factor" not in params and _get(config, "partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = _get(config, "partial_rotary_factor")
    rope_type = params.get("rope_type", params.get("type", "default"))
    original = _get(config, "original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope") and original is not None:
        params["original_max_position_embeddings"] = original  # transformers gives the top level priority
    head_dim = _get(config, "head_dim")
    if head_dim is None:
        hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
        if hidden is None or heads is None:
            raise ValueError("config has neither head_dim nor hidden_size and num_attention_heads; cannot tell the head dimension")
        if isinstance(hidden, bool) or isinstance(heads, bool) or not isinstance(hidden, int) or not isinstance(heads, int):
            raise TypeError(f"config.hidden_size and config.num_attention_heads must be ints, got {hidden!r} and {heads!r}")
        if heads < 1:
            raise ValueError(f"config.num_attention_heads must be >= 1, got {heads}")
        head_dim = hidden // heads
    return params, head_dim, _get(config, "max_position_embeddings")


# ----------------------------------------------------------------------------- the rotary module


class HFRotaryEmbedding(nn.Module):
    """transformers' rotary-embedding call, computed by the package: ``(x, position_ids) -> (cos, sin)``.

    Build it with :func:`rotary_embedding`. ``forward`` returns the full-width tables
    ``cat(c, c)`` of the half-split layout, ``c = s * cos(p * theta_i)`` (and likewise ``sin``),
    ``s`` the attention factor of YaRN and LongRoPE (1 otherwise), shape
    ``position_ids.shape + (rotary_dim,)``, in ``x``'s dtype; ``x`` gives only the dtype and
    device, as in transformers. The angles are ``float32(p) * inv_freq`` in float32 and the
    tables are rounded to ``x``'s dtype last: transformers' operations, so the result is
    bit for bit transformers' (in bf16, transformers rounds these tables to bf16 and then
    rotates in bf16; see the book's page on transformers).

    Dynamic types follow the positions of each call, with transformers' state
    (:class:`companion.rope.RotaryEmbedding` keeps it): ``dynamic`` recomputes its base
    when ``max(position_ids) + 1`` exceeds the longest length seen so far and returns to the
    original frequencies below ``max_position_embeddings``; ``longrope`` takes its long
    factors past ``original_max_position_embeddings``.

    Attributes:
        rope: the :class:`companion.rope.RotaryEmbedding` that holds the frequencies
            (``rope.inv_freq``, ``rope.attention_scaling``, ``rope.rope_config``).
        rotary_dim: the width of the tables.
        identity: ``True`` for the module :func:`use_scheme` installs with ``rope=False``
            (``cos = 1``, ``sin = 0``: the rotation leaves queries and keys unchanged).
    """

    def __init__(self, rope: RotaryEmbedding, *, identity: bool = False) -> None:
        super().__init__()
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be a companion.rope.RotaryEmbedding, got {type(rope).__name__}")
        self.rope = rope
        self.rotary_dim = rope.rotary_dim
        self.identity = bool(identity)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Full-width ``(cos, sin)`` for ``position_ids`` (``(batch, seq)`` or ``(seq,)``), in ``x``'s dtype.

        Raises:
            TypeError: ``x`` is not a floating-point tensor, or ``position_ids`` not integers.
            ValueError: ``position_ids`` is not 1-D or 2-D, or holds a position outside
                ``[-2**24, 2**24)`` (float32, the dtype of the angles, holds every integer
                only up to ``2**24``).
        """
        x = check_float_tensor(x, "x")
        pos = check_int_tensor(position_ids, "position_ids", dims=(1, 2))
        if pos.numel():
            hi, lo = int(pos.max()), int(pos.min())
            if max(hi, -lo) >= _FP32_EXACT_INT:
                raise ValueError(
                    f"position_ids must lie in [-2**24, 2**24) = [-{_FP32_EXACT_INT}, {_FP32_EXACT_INT}): the angles are "
                    f"float32, which holds every integer only up to 2**24; got {hi if hi >= -lo else lo}"
                )
        pos = pos.to(x.device)
        if self.identity:
            shape = (*pos.shape, self.rotary_dim)
            return (torch.ones(shape, dtype=x.dtype, device=x.device),
                    torch.zeros(shape, dtype=x.dtype, device=x.device))
        rope = self.rope
        if rope.rope_spec is not None and rope.rope_spec.is_dynamic and pos.numel():
            rope._follow_length(int(pos.max()) + 1)  # transformers' dynamic_rope_update, one state
        inv_freq = rope.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(pos, inv_freq, attention_scaling=rope.attention_scaling)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        return "identity (cos = 1, sin = 0)" if self.identity else f"rotary_dim={self.rotary_dim}"


def rotary_embedding(config: object, *, device: torch.device | str | None = None) -> HFRotaryEmbedding:
    """A drop-in replacement for a transformers model's rotary embedding, built from its config.

    ``model.model.rotary_emb = rotary_embedding(model.config)`` swaps it into a Llama-family
    model (Llama, Mistral, Qwen2, SmolLM, ...); the logits of a float32 model stay bit for bit
    the same for every scaling type (``default``, ``linear``, ``dynamic``, ``yarn``,
    ``longrope``, ``llama3``, ``proportional``). The frequencies are those of
    :func:`companion.scaling.compute_inv_freq` for :func:`rope_config_of`'s dict; the width
    of the tables is the config's rotary dimension, ``int(head_dim * partial_rotary_factor)``
    (``head_dim`` for ``proportional``). Llama's own class ignores a ``partial_rotary_factor``
    for the ``default`` type: such a config does not describe a Llama.

    Args:
        config: a transformers config (``model.config``) or a ``config.json`` dict, in the v5
            form (``rope_parameters``) or the legacy one (``rope_scaling`` and ``rope_theta``).
        device: where to put the frequencies (default: the CPU; ``model.to(...)`` moves them
            with the model).

    Returns:
        An :class:`HFRotaryEmbedding`.

    Raises:
        TypeError: ``config`` is not a config.
        ValueError: as :func:`rope_config_of` and :func:`companion.scaling.parse_rope_config`
            (an unknown ``rope_type``, a missing or bad key, named).
    """
    params, head_dim, max_pos = rope_config_of(config)
    rope = RotaryEmbedding(head_dim, rope_config=params, max_position_embeddings=max_pos, device=device)
    return HFRotaryEmbedding(rope)


# ----------------------------------------------------------------------------- attention


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The package's attention in transformers' calling convention (``AttentionInterface``).

    transformers calls it as ``(module, query, key, value, attention_mask, scaling=...,
    dropout=..., **kwargs)`` with ``query`` ``(batch, heads, q_len, head_dim)`` and ``key``,
    ``value`` ``(batch, kv_heads, k_len, head_dim)``, already rotated; it returns ``(out,
    None)``, ``out`` ``(batch, q_len, heads, head_dim)``, as transformers' ``"sdpa"`` does.
    The work is :func:`companion.dispatch.fast_attention` (grouped-query attention included,
    without repeating keys), with the position-bias scheme :func:`use_scheme` attached to
    ``module``, if any.

    ``attention_mask`` is what the registered mask function (transformers' ``sdpa_mask``)
    builds: a bool ``(batch, 1, q_len, k_len)`` mask (``True`` = attend) that carries the
    causal pattern and the padding, or ``None`` where a plain causal mask suffices; then the
    attention is causal when ``q_len > 1`` and the module is causal (``module.is_causal``, or
    an ``is_causal`` keyword), and, as in ``"sdpa"``, keys past ``q_len`` (the empty slots of
    a static cache at prefill) are dropped. A custom 4-D float mask passes through and is
    added to the logits.

    A bias scheme sees sequence indices as positions: keys ``0 .. k_len - 1`` (the cache
    slots) and queries the last ``q_len`` of them. In a left-padded batch they differ from the
    tokens' positions by a constant per row, which a relative bias (ALiBi, T5, Kerple) does
    not see; with a static cache (``k_len`` counts empty slots) a bias would see the wrong
    distances, so use the default dynamic cache with a scheme.

    Raises:
        ValueError: ``dropout`` is not 0 (call ``model.eval()`` or set the config's
            ``attention_dropout`` to 0), or transformers asks for soft-capping, attention
            sinks or a ``position_bias`` (none of which the package's attention has); and
            whatever :func:`~companion.dispatch.fast_attention` raises for its inputs.
    """
    if dropout:
        raise ValueError(
            f"dropout must be 0 for the companion attention (it has no dropout), got {dropout!r}; call "
            f"model.eval() or set config.attention_dropout = 0.0"
        )
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"the companion attention has no {name!r} (transformers passed one); use attn_implementation='eager' "
                f"for this model"
            )
    scheme = getattr(module, SCHEME_ATTRIBUTE, None)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q_len = query.shape[2]
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and key.shape[2] > q_len:  # a static cache at prefill: the slots past q_len are empty
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = fast_attention(query, key, value, scheme, causal=causal, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = ATTENTION_NAME) -> str:
    """Register :func:`attention_forward` and its mask function with transformers under ``name``.

    Two registrations, both needed: ``AttentionInterface[name]`` is the attention, and
    ``AttentionMaskInterface[name]`` (transformers' ``sdpa_mask``: bool masks, ``None`` for a
    plain causal one) makes transformers build the causal-and-padding mask for it. Without
    the second, transformers passes ``attention_mask=None`` to a custom attention, and a
    padded batch silently attends to its padding. Importing :mod:`companion.hf` registers
    :data:`ATTENTION_NAME`; registering again is harmless.

    Args:
        name: the ``attn_implementation`` to register, a non-empty string that is not one of
            transformers' own (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...).

    Returns:
        ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty or one of transformers' own implementations.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string (an attn_implementation), got {type(name).__name__}")
    builtin = {"eager", "sdpa", "flex_attention", "paged|eager"} | {f"flash_attention_{i}" for i in (2, 3, 4)}
    if not name or name in builtin or name.startswith("paged|"):
        raise ValueError(
            f"name must be a new attn_implementation, not empty nor one of transformers' own {sorted(builtin)}, got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that call the attention interface: transformers' attention
    classes (``LlamaAttention`` and its copies) hold ``num_key_value_groups`` and ``scaling``."""
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "scaling")]


def use_scheme(model: nn.Module, scheme: PositionScheme | None, *, rope: bool = True) -> nn.Module:
    """Give every attention layer of a transformers model a position-bias scheme.

    The scheme's ``bias`` is added to the logits by :func:`attention_forward`, so the model
    must run the package's attention (loaded with ``attn_implementation="companion"``, or
    ``model.set_attn_implementation("companion")``). One scheme object is shared by all
    layers (a learned one, T5's table or Kerple's parameters, is one set of parameters; pass
    ``use_scheme`` once per model). ``scheme=None`` removes it.

    Args:
        model: a transformers model (``PreTrainedModel``) running the companion attention.
        scheme: a :class:`companion.attention.PositionScheme` with only the ``bias`` hook
            (:class:`companion.alibi.ALiBi`, :class:`companion.relative.T5RelativeBias`,
            :class:`companion.learned_bias.KerpleBias`), built for the model's number of
            attention heads; or ``None``.
        rope: ``False`` replaces every rotary-embedding module of the model (those whose class
            name ends in ``RotaryEmbedding``, the transformers convention) with the identity
            (``cos = 1``, ``sin = 0``), so the scheme is the model's only position signal (an
            ALiBi Llama). ``True`` (the default) keeps the model's RoPE.

    Returns:
        ``model``, changed in place.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, ``scheme`` not a position scheme,
            ``rope`` not a bool.
        ValueError: the model does not run the companion attention, has no attention layers
            this function recognises, or the scheme has another hook than ``bias`` (a
            ``rotate`` scheme belongs in the rotary module: :func:`rotary_embedding`), or
            was built for another number of heads.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers model (a torch.nn.Module), got {type(model).__name__}")
    if not isinstance(rope, bool):
        raise TypeError(f"rope must be a bool (True or False), got {type(rope).__name__} {rope!r}")
    if scheme is not None:
        if not isinstance(scheme, PositionScheme):
            raise TypeError(f"scheme must be a companion PositionScheme or None, got {type(scheme).__name__}")
        hooks = scheme.hooks()
        if hooks != ("bias",):
            raise ValueError(
                f"scheme must have only the 'bias' hook (ALiBi, T5RelativeBias, KerpleBias); {type(scheme).__name__} "
                f"has {list(hooks)}: a 'rotate' scheme replaces the rotary module (companion.hf.rotary_embedding)"
            )
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if AttentionInterface().get(implementation) is not attention_forward:
        raise ValueError(
            f"model must run the companion attention to use a scheme, but its attn_implementation is "
            f"{implementation!r}; load it with attn_implementation={ATTENTION_NAME!r} or call "
            f"model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no attention layers that use_scheme recognises "
                         f"(modules with num_key_value_groups and scaling, as LlamaAttention)")
    heads = _get(config, "num_attention_heads")
    if scheme is not None and isinstance(heads, int):
        scheme.check_heads(heads)
    for layer in layers:
        setattr(layer, SCHEME_ATTRIBUTE, scheme)
    if not rope:
        slots = [(parent, name) for parent in model.modules() if not isinstance(parent, HFRotaryEmbedding)
                 for name, child in parent.named_children() if type(child).__name__.endswith("RotaryEmbedding")]
        for parent, name in slots:
            identity = rotary_embedding(config)
            identity.identity = True
            setattr(parent, name, identity)
    return model
