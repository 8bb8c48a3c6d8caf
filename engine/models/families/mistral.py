"""Mistral: Llama layers where every layer attends within one sliding window."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.families.llama import unpermute_gguf_qk

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="mistral", **hf.common(), sliding_window=int(window) if window is not None else None
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    window = meta.get("attention.sliding_window")
    return ModelConfig(architecture="mistral", **meta.common(), sliding_window=int(window) if window else None)


FAMILY = Family(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=("mistral",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_weight=unpermute_gguf_qk,
    summary="Mistral: Llama layers, one sliding window on every layer",
)
