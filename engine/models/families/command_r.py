"""Command-R (Cohere, ``CohereForCausalLM``): parallel attention and MLP from one LayerNorm.

What differs from Llama, and where the shared Decoder takes it from ModelConfig:

* one norm per layer, a LayerNorm without bias (eps ``layer_norm_eps``), whose output
  feeds attention and the SwiGLU MLP side by side: ``x + attn(h) + mlp(h)``
  (``norm_placement="parallel"``);
* rope turns adjacent pairs of each head (transformers' modeling_cohere repeats each
  frequency twice and rotates ``(x[2i], x[2i+1])``; llama.cpp's "norm" rope), so
  ``rope_interleaved``; llama.cpp's converter keeps Hugging Face's q/k rows, and both
  formats load as stored;
* the logits are multiplied by ``logit_scale`` (0.0625 by default);
* tied embeddings by default; q/k/v/o biases when ``attention_bias``.

Command R+'s per-head q/k LayerNorms (``use_qk_norm``) are refused by name. These blocks
are not in the fused C++ step: Command-R serves on the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

DEFAULT_NORM_EPS = 1e-5  # transformers' CohereConfig and llama.cpp
DEFAULT_LOGIT_SCALE = 0.0625
_QK_NORM = "per-head q/k LayerNorms (Command R+'s use_qk_norm) are not supported"


def _blocks(bias: bool, logit_scale: float) -> dict:
    return dict(
        norm="layer",
        norm_placement="parallel",
        rope_interleaved=True,
        attention_bias=bias,
        o_proj_bias=bias,
        logit_scale=logit_scale,
    )


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation("silu")
    if hf.get("use_qk_norm"):
        raise hf.error(f"use_qk_norm=true: {_QK_NORM}")
    common = hf.common()
    common["rms_norm_eps"] = float(hf.get("layer_norm_eps", DEFAULT_NORM_EPS))
    common["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    blocks = _blocks(bool(hf.get("attention_bias", False)), float(hf.get("logit_scale", DEFAULT_LOGIT_SCALE)))
    return ModelConfig(architecture="command_r", **common, **blocks)


def from_gguf(meta: GGUFFields) -> ModelConfig:
    common = meta.common()
    if common.pop("qk_norm"):
        raise meta.error(f"tensor 'blk.0.attn_q_norm.weight': {_QK_NORM}")
    common["rms_norm_eps"] = float(meta.get("attention.layer_norm_epsilon", DEFAULT_NORM_EPS))
    common.pop("attention_bias")
    blocks = _blocks(meta.has_tensor("blk.0.attn_q.bias"), float(meta.get("logit_scale", DEFAULT_LOGIT_SCALE)))
    return ModelConfig(architecture="command_r", **common, **blocks)


FAMILY = Family(
    name="command_r",
    hf_model_types=("cohere",),
    gguf_architectures=("command-r",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    summary="Command-R (Cohere): parallel attention/MLP from one LayerNorm, interleaved rope, logit scale",
)
