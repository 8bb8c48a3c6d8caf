"""The token-routed MoE family: Llama attention, and on every layer experts chosen by integer
arithmetic on the token id, ``expert = (token_id >> expert_token_shift) & (num_experts - 1)``:
no router weights, one expert per token at weight 1, floats only inside the expert MLPs.

No transformers implementation exists; its checkpoint is a config.json with ``model_type``
``"token_moe"`` (Llama's keys plus ``num_experts``, a power of two, and optionally
``expert_token_shift``; ``intermediate_size`` is each expert's) and safetensors named as
Qwen-MoE names its experts: ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families import moe_family
from protoserve.engine.models.families.family import Family, no_gguf
from protoserve.engine.models.moe import QWEN_EXPERT_NAMES

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.hf_fields import HFFields

NAMES = moe_family.MoeNames("mlp.", QWEN_EXPERT_NAMES)


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    common = hf.common()
    num_experts = int(hf.need("num_experts"))
    if num_experts < 1 or num_experts & (num_experts - 1):
        raise hf.error(f"num_experts must be a power of two (the route masks the id), got {num_experts}")
    shift = int(hf.get("expert_token_shift", 0))
    if not 0 <= shift < 63:
        raise hf.error(f"expert_token_shift must be in 0..62, got {shift}")
    return ModelConfig(
        architecture="token_moe",
        **common,
        num_experts=num_experts,
        experts_per_token=1,
        moe_intermediate_size=common["intermediate_size"],
        moe_routing="token",
        moe_token_shift=shift,
    )


FAMILY = Family(
    name="token_moe",
    hf_model_types=("token_moe",),
    gguf_architectures=(),
    config_from_hf=from_hf,
    config_from_gguf=no_gguf("token_moe"),
    hf_shapes=lambda config: moe_family.hf_shapes(config, NAMES),
    active_parameters=lambda config: moe_family.active_parameters(config, NAMES),
    moe_names=NAMES,
    fused_step_unsupported=lambda config: "mixture-of-experts layers",
    summary="token-routed MoE: Llama attention, expert = (token_id >> shift) & (E - 1), no router",
)
