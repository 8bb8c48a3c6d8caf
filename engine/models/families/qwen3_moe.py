"""Qwen3-MoE: Qwen3's attention (q/k norms) with mixture-of-experts MLPs (softmax top-k, renormalised
iff ``norm_topk_prob``) on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse;
the others keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families import moe_family, qwen3
from protoserve.engine.models.families.family import LLAMA_GGUF_LAYER_NAMES, Family
from protoserve.engine.models.moe import QWEN_EXPERT_NAMES

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

NAMES = moe_family.MoeNames("mlp.", QWEN_EXPERT_NAMES)


def moe_layers(num_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[bool]:
    """transformers' rule: layer i is sparse iff it is not in mlp_only_layers and (i + 1) % step == 0."""
    return [num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(num_layers)]


def from_hf(hf: HFFields) -> ModelConfig:
    """Qwen3's attention and windows as qwen3.py reads them, with the experts on top."""
    dense = qwen3.from_hf(hf)
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise hf.error(f"decoder_sparse_step must be at least 1, got {step}")
    mlp_only = [int(i) for i in hf.get("mlp_only_layers", [])]
    # Qwen's own files say num_experts; transformers 5 writes num_local_experts (its attribute map).
    num_experts = int(hf.need("num_experts" if "num_experts" in hf.raw else "num_local_experts"))
    return dataclasses.replace(
        dense,
        architecture="qwen3_moe",
        num_experts=num_experts,
        experts_per_token=int(hf.need("num_experts_per_tok")),
        moe_intermediate_size=int(hf.need("moe_intermediate_size")),
        moe_normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        moe_layers=moe_layers(dense.num_layers, num_experts, step, mlp_only),
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    """llama.cpp's qwen3moe: a layer is sparse where it has a router (``ffn_gate_inp``)."""
    common = meta.common()
    layers = [meta.has_tensor(f"blk.{i}.ffn_gate_inp.weight") for i in range(common["num_layers"])]
    return ModelConfig(
        architecture="qwen3_moe",
        **common,
        num_experts=int(meta.require("expert_count")),
        experts_per_token=int(meta.require("expert_used_count")),
        moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
        moe_normalize_top_k=bool(meta.get("expert_weights_norm", True)),
        moe_layers=layers,
    )


FAMILY = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "ffn_gate_inp": "mlp.gate"},
    gguf_expert_names={"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                       "ffn_down_exps": "mlp.experts.{e}.down_proj"},
    hf_shapes=lambda config: moe_family.hf_shapes(config, NAMES),
    active_parameters=lambda config: moe_family.active_parameters(config, NAMES),
    moe_names=NAMES,
    fused_step_unsupported=lambda config: "mixture-of-experts layers",
    summary="Qwen3-MoE: Qwen3 attention, softmax top-k experts (norm_topk_prob), sparse-step layers",
)
