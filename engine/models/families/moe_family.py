"""What every mixture-of-experts family shares: its MoE block from the config, its expert
tensors' names and shapes, and its parameters per token.

A family module (mixtral.py, qwen3_moe.py, token_moe.py) sets ``Family.moe_names`` to where its
checkpoints keep a layer's MoE block, and ``hf_shapes`` / ``active_parameters`` to the functions
here; the Decoder builds the blocks from ``block_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.weights import expected_hf_shapes
from protoserve.engine.models.moe import ExpertNames, MoEConfig, hf_weight_shapes

_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class MoeNames:
    """Where a checkpoint keeps layer i's MoE block: ``model.layers.{i}.{prefix}`` and its experts' names."""

    prefix: str  # "block_sparse_moe." (Mixtral) or "mlp." (Qwen-MoE)
    experts: ExpertNames


def block_config(config: ModelConfig) -> MoEConfig:
    """The MoE block of a config's MoE layers."""
    c = config
    return MoEConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.moe_intermediate_size,
        num_experts=c.num_experts,
        top_k=c.experts_per_token,
        routing=c.moe_routing,
        normalize_top_k=c.moe_normalize_top_k,
        token_shift=c.moe_token_shift,
        shared_intermediate_size=c.moe_shared_intermediate_size,
        shared_expert_gate=c.moe_shared_expert_gate,
        num_groups=c.moe_num_groups,
        topk_groups=c.moe_topk_groups,
        routed_scaling_factor=c.moe_routed_scaling_factor,
    )


def hf_shapes(config: ModelConfig, names: MoeNames) -> dict[str, tuple[int, ...]]:
    """Every tensor of an MoE model: the dense model's, with each MoE layer's MLP replaced by its block."""
    shapes = expected_hf_shapes(config)
    block = block_config(config)
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            for suffix in _DENSE_MLP:
                del shapes[f"model.layers.{i}.{suffix}"]
            shapes.update(hf_weight_shapes(block, f"model.layers.{i}.{names.prefix}", names.experts))
    return shapes


def active_parameters(config: ModelConfig, names: MoeNames) -> int:
    """Parameters a token passes through: everything but the experts it is not routed to."""
    total = sum(math.prod(s) for s in hf_shapes(config, names).values())
    block = block_config(config)
    all_experts, active_experts = block.parameter_counts()
    skipped = all_experts - active_experts
    return total - skipped * sum(config.is_moe_layer(i) for i in range(config.num_layers))
