"""Qwen3: Llama layers with per-head q/k RMSNorm; optional per-layer sliding windows as Qwen2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

# transformers' Qwen3Config default when config.json omits head_dim.
DEFAULT_HEAD_DIM = 128


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    common = hf.common()
    if "head_dim" not in hf.raw:
        common["head_dim"] = DEFAULT_HEAD_DIM
    window, layer_types = hf.qwen_windows(common["num_layers"])
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        architecture="qwen3",
        **common,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        sliding_window=window,
        layer_types=layer_types,
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    return ModelConfig(architecture="qwen3", **meta.common())


FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    summary="Qwen3 (dense): q/k norms, optional per-layer sliding windows",
)
