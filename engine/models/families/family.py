"""Family: what one model family declares, so adding a family is one module.

A family module (llama.py, gemma3.py, ...) builds one ``Family`` and says:

* which checkpoints are its own: Hugging Face ``model_type`` values and GGUF
  ``general.architecture`` names;
* how their configuration maps onto ModelConfig (``config_from_hf`` reads
  config.json, ``config_from_gguf`` the GGUF metadata); the ModelConfig it returns
  also carries the family's blocks (MLP kind, norm placement, q/k norm, windows,
  rope bases), which the shared Decoder composes;
* its weight names: every tensor by Hugging Face name and shape as its files hold
  them (``hf_shapes``; the dense default follows the blocks in ModelConfig, an MoE
  family lists its experts), GGUF ``blk.N.<part>`` names onto Hugging Face suffixes,
  and any per-tensor transform the source format needs (llama.cpp's q/k row
  permutation, Gemma's ``1 + w`` norms, Phi-3's fused projections split);
* its parameters used per token (``active_parameters``; None: all of them);
* what the fused C++ step cannot run yet (``fused_step_unsupported``).

Weights are always named as in Hugging Face checkpoints (``model.layers.N.…``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.moe_family import MoeNames
from protoserve.engine.models.families.weights import expected_hf_shapes
from protoserve.engine.models.rope import rotary_dim_of

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

# llama.cpp's per-layer tensor parts -> Hugging Face suffixes, as its converter names them for
# Llama-like families. A family with other parts (Gemma's sandwich norms) declares its own map.
# The pre norms and separate q/k/v/o every such family shares (StarCoder2 adds its own MLP's):
PRE_NORM_ATTENTION_GGUF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
    }
)
LLAMA_GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        **PRE_NORM_ATTENTION_GGUF_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
GGUF_GLOBAL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output_norm.bias": "model.norm.bias",
        "output.weight": "lm_head.weight",
    }
)

# (config, Hugging Face name, tensor) -> the tensor the decoder takes under that name.
WeightTransform = Callable[[ModelConfig, str, torch.Tensor], torch.Tensor]


# (config, Hugging Face name, tensor) -> the decoder's tensors it holds, by Hugging Face name.
WeightSplit = Callable[[ModelConfig, str, torch.Tensor], dict[str, torch.Tensor]]


def keep_weight(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def whole_weight(config: ModelConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: tensor}


def fused_step_lacks(config: ModelConfig) -> str | None:
    """The blocks of ``config`` that kernels/cpu/decoder_step.cpp does not compute (RMSNorms, a gated
    MLP, half-split rope over whole heads and uncapped attention scores are what it runs), or None."""
    lacking = [
        what
        for what, present in (
            ("LayerNorm", config.norm == "layer"),
            ("a parallel attention/MLP block", config.norm_placement == "parallel"),
            ("an MLP without a gate", config.mlp == "gelu"),
            ("interleaved rope", config.rope_interleaved),
            ("attention-logit soft-capping", config.attn_logit_softcapping is not None),
            ("partial rotary", rotary_dim_of(config.head_dim, config.rope_scaling) < config.head_dim),
        )
        if present
    ]
    return ", ".join(lacking) or None


def no_gguf(family: str) -> Callable[[GGUFFields], ModelConfig]:
    """config_from_gguf of a family whose GGUF form is not read (its gguf_architectures is empty)."""

    def refuse(meta: GGUFFields) -> ModelConfig:
        raise meta.error(f"GGUF files of the {family} family are not supported; load its safetensors checkpoint")

    return refuse


@dataclass(frozen=True)
class Family:
    """One model family: its checkpoint names, config mapping, weight names and blocks."""

    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[HFFields], ModelConfig]
    config_from_gguf: Callable[[GGUFFields], ModelConfig]
    hf_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = expected_hf_shapes
    active_parameters: Callable[[ModelConfig], int] | None = None  # an MoE family's per-token count
    moe_names: MoeNames | None = None  # an MoE family: where its checkpoints keep each layer's block
    # An MoE family's GGUF parts that stack every expert ([experts, rows, cols], llama.cpp's
    # ``ffn_*_exps``) onto the Hugging Face suffix of expert {e}, e.g. "mlp.experts.{e}.gate_proj".
    gguf_expert_names: Mapping[str, str] = field(default_factory=dict)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    hf_weight: WeightTransform = keep_weight  # applied to each safetensors tensor
    gguf_weight: WeightTransform = keep_weight  # applied to each dequantized GGUF tensor
    # Applied to every tensor of either format once checked against ``hf_shapes``: a family whose
    # files fuse several of the decoder's tensors into one (Phi-3's qkv_proj) splits them here.
    split_weight: WeightSplit = whole_weight
    # Why the fused C++ step cannot run a config of this family (None: it can); the Decoder then
    # serves it on the module path and logs the reason.
    fused_step_unsupported: Callable[[ModelConfig], str | None] = fused_step_lacks
    # The chat template to use when a checkpoint carries none (a base model's file may not).
    chat_template: str | None = None
    summary: str = ""  # one line for the docs and errors
