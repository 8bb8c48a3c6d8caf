"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): Llama layers with fused projections, LongRoPE, partial rotary.

What differs from Llama, and where the shared Decoder takes it from ModelConfig:

* checkpoints keep q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (gate rows
  first): ``hf_shapes`` lists them so, and ``split_weight`` hands the decoder its parts;
* LongRoPE: short and long factor sets, ``original_max_position_embeddings`` at the top
  level of config.json, the legacy type names "su" and "yarn" read as longrope as Phi-3's
  config class does (engine/models/rope_config.py; which set serves: engine/models/rope.py);
* ``partial_rotary_factor`` (Phi-4-mini: the leading 3/4 of each head rotate, with tied
  embeddings), which the fused C++ step lacks: such a model serves on the module path;
* one sliding window on every layer where the config sets one (Phi-3-mini's 2047).

llama.cpp's ``phi3`` GGUF holds the same fused tensors (``attn_qkv``; ``ffn_up`` with gate then
up), rotates halves (q/k rows as stored), keeps the factor sets as ``rope_factors_long/short``
tensors and the rotated dims as ``rope.dimension_count``, and writes a window of 0 for none (Phi-4).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.families.weights import expected_hf_shapes

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

DEFAULT_RMS_NORM_EPS = 1e-5  # transformers' Phi3Config
ROPE_ALIASES: Mapping[str, str] = MappingProxyType({"su": "longrope", "yarn": "longrope"})
# A fused tensor -> the decoder's parts, in its row order.
FUSED: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
})
GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
})


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    hidden, heads = int(hf.need("hidden_size")), int(hf.need("num_attention_heads"))
    common = hf.common(hf.rope(int(hf.get("head_dim", hidden // heads)), ROPE_ALIASES))
    common["rms_norm_eps"] = float(hf.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS))
    window = hf.get("sliding_window")
    return ModelConfig(architecture="phi3", **common, sliding_window=None if window is None else int(window))


def from_gguf(meta: GGUFFields) -> ModelConfig:
    window = meta.get("attention.sliding_window")
    return ModelConfig(architecture="phi3", **meta.common(), sliding_window=int(window) if window else None)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The dense model's tensors with each layer's q/k/v and gate/up stored as one."""
    shapes = expected_hf_shapes(config)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            rows = sum(shapes.pop(f"{prefix}{part}.weight")[0] for part in parts)
            shapes[f"{prefix}{fused}.weight"] = (rows, config.hidden_size)
    return shapes


def _part_rows(config: ModelConfig, fused: str) -> list[int]:
    if fused == "mlp.gate_up_proj":
        return [config.intermediate_size] * 2
    kv = config.num_kv_heads * config.head_dim
    return [config.num_heads * config.head_dim, kv, kv]


def split_fused(config: ModelConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused projection's parts (views) under the decoder's names; any other tensor as it is."""
    for fused, parts in FUSED.items():
        suffix = f"{fused}.weight"
        if name.startswith("model.layers.") and name.endswith(suffix):
            prefix = name[: -len(suffix)]
            pieces = tensor.split(_part_rows(config, fused))
            return {f"{prefix}{part}.weight": piece for part, piece in zip(parts, pieces, strict=True)}
    return {name: tensor}


FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    hf_shapes=hf_shapes,
    gguf_layer_names=GGUF_LAYER_NAMES,
    split_weight=split_fused,
    summary="Phi-3/3.5/4: fused qkv and gate/up, LongRoPE short/long factors, partial rotary, sliding window",
)
