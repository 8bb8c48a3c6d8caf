"""Qwen2: Llama layers with q/k/v biases; sliding windows on the layers from max_window_layers on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    common = hf.common()
    window, layer_types = hf.qwen_windows(common["num_layers"])
    return ModelConfig(
        architecture="qwen2", **common, attention_bias=True, sliding_window=window, layer_types=layer_types
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    return ModelConfig(architecture="qwen2", **meta.common())


FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    summary="Qwen2/2.5: q/k/v biases, optional per-layer sliding windows",
)
