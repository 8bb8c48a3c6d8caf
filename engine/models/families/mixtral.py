"""Mixtral: Mistral's attention with a mixture-of-experts MLP on every layer (softmax top-2 router,
the two weights renormalised), experts named ``block_sparse_moe.experts.{e}.w1/w3/w2``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families import moe_family
from protoserve.engine.models.families.family import LLAMA_GGUF_LAYER_NAMES, Family
from protoserve.engine.models.families.llama import unpermute_gguf_qk
from protoserve.engine.models.moe import MIXTRAL_EXPERT_NAMES

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

NAMES = moe_family.MoeNames("block_sparse_moe.", MIXTRAL_EXPERT_NAMES)


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    common = hf.common()
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="mixtral",
        **common,
        sliding_window=int(window) if window is not None else None,
        num_experts=int(hf.need("num_local_experts")),
        experts_per_token=int(hf.need("num_experts_per_tok")),
        moe_intermediate_size=common["intermediate_size"],
        moe_normalize_top_k=True,
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    """llama.cpp's form: architecture "llama" with ``expert_count`` (the llama family hands it over)."""
    common = meta.common()
    window = meta.get("attention.sliding_window")
    return ModelConfig(
        architecture="mixtral",
        **common,
        sliding_window=int(window) if window else None,
        num_experts=int(meta.require("expert_count")),
        experts_per_token=int(meta.require("expert_used_count")),
        moe_intermediate_size=int(meta.get("expert_feed_forward_length", common["intermediate_size"])),
        moe_normalize_top_k=True,
    )


FAMILY = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=(),  # filed under "llama" by llama.cpp; llama.from_gguf hands it over
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_weight=unpermute_gguf_qk,
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
    gguf_expert_names={"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                       "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                       "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    hf_shapes=lambda config: moe_family.hf_shapes(config, NAMES),
    active_parameters=lambda config: moe_family.active_parameters(config, NAMES),
    moe_names=NAMES,
    fused_step_unsupported=lambda config: "mixture-of-experts layers",
    summary="Mixtral: Mistral attention, softmax top-k MoE on every layer",
)
