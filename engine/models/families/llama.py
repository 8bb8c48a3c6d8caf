"""Llama (2/3, SmolLM2): pre-norm SwiGLU layers, RoPE with optional linear/llama3 scaling.

llama.cpp's converter permutes the rows of Llama's q/k projections (its rope
rotates adjacent pairs); loading a GGUF undoes that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation for ``n_heads`` heads.

    The converter regroups each head's rows from HF's rotate-half layout
    (first half, second half) into interleaved pairs; this puts them back.
    Works for weights ``(rows, cols)`` and biases ``(rows,)``.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_gguf_qk(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """llama.cpp permuted q/k rows of Llama-layout GGUF files: put them back in HF order."""
    if name.startswith("model.layers.") and ".self_attn.q_proj." in name:
        return unpermute_qk(tensor, config.num_heads)
    if name.startswith("model.layers.") and ".self_attn.k_proj." in name:
        return unpermute_qk(tensor, config.num_kv_heads)
    return tensor


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(architecture="llama", **hf.common(), attention_bias=bias, o_proj_bias=bias)


def from_gguf(meta: GGUFFields) -> ModelConfig:
    if meta.get("expert_count"):  # llama.cpp writes Mixtral as "llama" with experts
        from protoserve.engine.models.families.mixtral import from_gguf as mixtral_from_gguf

        return mixtral_from_gguf(meta)
    fields = meta.common()
    return ModelConfig(architecture="llama", **fields, o_proj_bias=meta.has_tensor("blk.0.attn_output.bias"))


FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_weight=unpermute_gguf_qk,
    summary="Llama 2/3, SmolLM2: pre-norm SwiGLU, rope (linear, llama3 scaling)",
)
