"""Gemma 2: Gemma 3's blocks (gemma3.py) with attention-logit soft-capping and no q/k norms.

What differs from Gemma 3:

* local (sliding) and global layers alternate one to one, the first sliding, and
  both kinds rotate by the one rope base;
* attention scores are soft-capped, ``cap * tanh(scores / cap)`` after the
  scaling (``attn_logit_softcapping``, 50 by default), as are the final logits
  (``final_logit_softcapping``, 30 by default); the fused C++ step has no
  capped scores, so Gemma 2 serves on the module path (attention on the tiled
  path, engine/models/attention.py);
* no per-head q/k norms.

Shared with Gemma 3: sandwich norms of ``1 + w`` (HF tensors shifted on load,
GGUF as llama.cpp stores them), GeGLU, embeddings scaled by sqrt(hidden_size),
attention scale ``query_pre_attn_scalar ** -0.5``, the GGUF tensor names, the
chat template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.families.gemma3 import (
    CHAT_TEMPLATE,
    GGUF_LAYER_NAMES,
    gemma_gguf_blocks,
    gemma_hf_blocks,
    shift_hf_norm,
)

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

SLIDING_WINDOW_PATTERN = 2  # every other layer global (transformers' and llama.cpp's rule for Gemma 2)
# (attention, final) soft-caps where a file does not say: transformers' Gemma2Config and llama.cpp agree.
DEFAULT_CAPS = (50.0, 30.0)
# llama.cpp's Gemma 2 27B (46 layers) scales attention by hidden/heads, every other size by head_dim.
_GGUF_27B_LAYERS = 46


def from_hf(hf: HFFields) -> ModelConfig:
    common = hf.common()
    common.update(gemma_hf_blocks(hf, common["num_layers"], SLIDING_WINDOW_PATTERN, DEFAULT_CAPS))
    return ModelConfig(architecture="gemma2", **common)


def from_gguf(meta: GGUFFields) -> ModelConfig:
    common = {**meta.common(), "qk_norm": False}  # q/k norm tensors in the file are then unexpected
    common.update(gemma_gguf_blocks(meta, common, SLIDING_WINDOW_PATTERN, _GGUF_27B_LAYERS, DEFAULT_CAPS))
    return ModelConfig(architecture="gemma2", **common)


FAMILY = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_layer_names=GGUF_LAYER_NAMES,
    hf_weight=shift_hf_norm,
    chat_template=CHAT_TEMPLATE,
    summary="Gemma 2: local/global layers, attention and final logit soft-capping, GeGLU, sandwich norms",
)
