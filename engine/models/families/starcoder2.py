"""StarCoder2: LayerNorms with biases, a GELU MLP without gate, biases on every projection.

What differs from Llama, and where the shared Decoder takes it from ModelConfig:

* every norm is a LayerNorm with a bias (``norm="layer"``, eps ``norm_epsilon``);
* the MLP is ``c_proj(gelu_tanh(c_fc(x)))`` (``mlp="gelu"``), kept under transformers' names;
* q/k/v/o and the MLP carry biases when ``use_bias`` (the default);
* every layer attends within ``sliding_window`` when the config sets one (as Mistral);
* tied embeddings by default.

llama.cpp's converter writes no sliding window for starcoder2 and llama.cpp attends
globally: a GGUF file slides only when it carries ``attention.sliding_window``.
Its rope rotates halves, as Hugging Face's, so GGUF q/k rows load as stored.
LayerNorm and the ungated MLP are blocks the fused C++ step lacks: StarCoder2 serves
on the module path.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import PRE_NORM_ATTENTION_GGUF_NAMES, Family
from protoserve.engine.models.families.gemma3 import GELU_TANH

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

DEFAULT_NORM_EPS = 1e-5  # transformers' Starcoder2Config and llama.cpp

GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {**PRE_NORM_ATTENTION_GGUF_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
)


def from_hf(hf: HFFields) -> ModelConfig:
    hf.require_activation(*GELU_TANH, default="gelu_pytorch_tanh")
    common = hf.common()
    common["rms_norm_eps"] = float(hf.get("norm_epsilon", DEFAULT_NORM_EPS))
    common["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    bias = bool(hf.get("use_bias", True))
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="starcoder2",
        **common,
        norm="layer",
        norm_bias=True,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp="gelu",
        mlp_bias=bias,
        sliding_window=None if window is None else int(window),
    )


def from_gguf(meta: GGUFFields) -> ModelConfig:
    common = meta.common()
    common["rms_norm_eps"] = float(meta.get("attention.layer_norm_epsilon", DEFAULT_NORM_EPS))
    window = meta.get("attention.sliding_window")
    return ModelConfig(
        architecture="starcoder2",
        **common,
        norm="layer",
        norm_bias=True,
        o_proj_bias=meta.has_tensor("blk.0.attn_output.bias"),
        mlp="gelu",
        mlp_bias=meta.has_tensor("blk.0.ffn_up.bias"),
        sliding_window=None if window is None else int(window),
    )


FAMILY = Family(
    name="starcoder2",
    hf_model_types=("starcoder2",),
    gguf_architectures=("starcoder2",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_layer_names=GGUF_LAYER_NAMES,
    summary="StarCoder2: LayerNorm with biases, GELU MLP, biased projections, sliding window",
)
