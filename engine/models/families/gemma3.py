"""Gemma 3 (text): interleaved sliding-window and global layers, GeGLU, sandwich norms.

What differs from Llama, and where the shared Decoder takes it from ModelConfig:

* layers alternate local sliding-window attention and global attention
  (``layer_types``; five local then one global by default), each kind with its
  own rope base (``rope_local_theta`` for local layers, without scaling);
* four norms per layer (before and after attention, before and after the MLP)
  and per-head q/k norms;
* GeGLU MLP (gelu, tanh approximation);
* embeddings scaled by sqrt(hidden_size) in the activation dtype;
* attention scale ``query_pre_attn_scalar ** -0.5``;
* optional final and attention logit soft-capping (shared with Gemma 2, gemma2.py).

Gemma's RMSNorm multiplies by ``1 + w``; Hugging Face checkpoints store ``w``,
llama.cpp's converter stores ``1 + w``. Weights are loaded as ``1 + w`` (the
HF tensors shifted on load, GGUF as stored), so the shared RMSNorm runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from protoserve.engine.models.config import FULL, SLIDING, ModelConfig
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.rope_config import RopeSettings, is_per_layer_type

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

# transformers' and llama.cpp's defaults where a file does not say.
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global
DEFAULT_LOCAL_ROPE_THETA = 10000.0
DEFAULT_GLOBAL_ROPE_THETA = 1_000_000.0  # of a per-layer-type rope_parameters without full_attention
DEFAULT_HEAD_DIM = 256
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# llama.cpp's Gemma 3 27B (62 layers) scales attention by hidden/heads, every other size by head_dim.
_GGUF_27B_LAYERS = 62

GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)

# Gemma's published chat template (google/gemma-3-*-it tokenizer_config.json, text parts only):
# used when a checkpoint carries none, as the 270M GGUF does.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every ``pattern``-th layer global, the others sliding (transformers' and llama.cpp's rule)."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _rope(hf: HFFields, head_dim: int) -> tuple[RopeSettings, float]:
    """(global rope, local theta) from per-layer-type rope_parameters or the old keys."""
    if not is_per_layer_type(hf.raw):
        return hf.rope(head_dim), float(hf.get("rope_local_base_freq", DEFAULT_LOCAL_ROPE_THETA))
    by_type = hf.rope_by_layer_type(head_dim)
    unknown = set(by_type) - {FULL, SLIDING}
    if unknown:
        raise hf.error(f"rope_parameters for unknown layer types {sorted(unknown)}")
    local = by_type.get(SLIDING) or RopeSettings(DEFAULT_LOCAL_ROPE_THETA, None)
    if local.scaling is not None:
        raise hf.error(f"rope scaling on sliding layers is not supported: {local.scaling}")
    return by_type.get(FULL) or RopeSettings(DEFAULT_GLOBAL_ROPE_THETA, None), local.theta


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def gemma_hf_blocks(
    hf: HFFields, num_layers: int, pattern: int, caps: tuple[float | None, float | None] = (None, None)
) -> dict[str, Any]:
    """The ModelConfig switches Gemma 2 and 3 read alike from config.json: GeGLU, sandwich norms,
    scaled embeddings, local/global layers (every ``pattern``-th global unless ``layer_types`` says),
    the attention scalar and both soft-caps (``caps``: transformers' defaults for a missing key,
    attention then final; an explicit null turns a cap off)."""
    hf.require_activation(*GELU_TANH, key="hidden_activation", default=hf.get("hidden_act", "gelu_pytorch_tanh"))
    if hf.get("use_bidirectional_attention"):
        raise hf.error("use_bidirectional_attention=true is not supported (a decoder attends causally)")
    layer_types = hf.layer_types(num_layers) or pattern_layer_types(num_layers, pattern)
    window = hf.get("sliding_window")
    if window is None and SLIDING in layer_types:
        raise hf.error("missing required key 'sliding_window' (layer_types has sliding layers)")
    bias = bool(hf.get("attention_bias", False))
    return dict(
        head_dim=int(hf.get("head_dim", DEFAULT_HEAD_DIM)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        attention_bias=bias,
        o_proj_bias=bias,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)),
        mlp="geglu",
        norm_placement="sandwich",
        scale_embeddings=True,
        attn_logit_softcapping=optional_float(hf.raw.get("attn_logit_softcapping", caps[0])),
        final_logit_softcapping=optional_float(hf.raw.get("final_logit_softcapping", caps[1])),
    )


def gemma_gguf_blocks(
    meta: GGUFFields, common: dict[str, Any], pattern: int, big_layers: int, caps: tuple[float | None, float | None]
) -> dict[str, Any]:
    """The switches Gemma 2 and 3 GGUF files give alike. llama.cpp scales attention by hidden/heads in
    the 27B model (``big_layers`` layers), by head_dim in every other size; ``caps`` are its defaults."""
    num_layers = common["num_layers"]
    window = meta.get("attention.sliding_window")
    scalar = common["hidden_size"] / common["num_heads"] if num_layers == big_layers else common["head_dim"]
    return dict(
        sliding_window=None if window is None else int(window),
        layer_types=pattern_layer_types(num_layers, pattern),
        o_proj_bias=meta.has_tensor("blk.0.attn_output.bias"),
        query_pre_attn_scalar=float(scalar),
        mlp="geglu",
        norm_placement="sandwich",
        scale_embeddings=True,
        attn_logit_softcapping=optional_float(meta.get("attn_logit_softcapping", caps[0])),
        final_logit_softcapping=optional_float(meta.get("final_logit_softcapping", caps[1])),
    )


def from_hf(hf: HFFields) -> ModelConfig:
    rope, local_theta = _rope(hf, int(hf.get("head_dim", DEFAULT_HEAD_DIM)))
    common = hf.common(rope)
    pattern = int(hf.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN))
    common.update(gemma_hf_blocks(hf, common["num_layers"], pattern))
    return ModelConfig(architecture="gemma3", **common, rope_local_theta=local_theta, qk_norm=True)


def from_gguf(meta: GGUFFields) -> ModelConfig:
    common = meta.common()
    # Files written so far carry no pattern or local rope base: llama.cpp fixes both for gemma3.
    pattern = int(meta.get("attention.sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN))
    common.update(gemma_gguf_blocks(meta, common, pattern, _GGUF_27B_LAYERS, (None, None)))
    return ModelConfig(
        architecture="gemma3", **common, rope_local_theta=float(meta.get("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_THETA))
    )


def shift_hf_norm(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """HF Gemma norms hold ``w`` of ``x * (1 + w)``: store ``1 + w`` (in float32, as HF adds it)."""
    if name.endswith("norm.weight"):
        return 1.0 + tensor.float()
    return tensor


FAMILY = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_layer_names=GGUF_LAYER_NAMES,
    hf_weight=shift_hf_norm,
    chat_template=CHAT_TEMPLATE,
    summary="Gemma 3 (text): local/global layers, GeGLU, sandwich norms, q/k norms",
)
