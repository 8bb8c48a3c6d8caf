"""The tensors a ModelConfig needs, by Hugging Face name and shape, and GGUF names onto them.

Shared by every dense family: the blocks in ModelConfig (biases, q/k norm,
norm placement) decide which tensors exist, so a family declares no list of
its own. A family with other blocks (an MoE MLP) sets ``Family.hf_shapes`` to
its own function of the same signature.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from protoserve.engine.models.config import ModelConfig

# Norms of a "sandwich" layer besides input_layernorm (Gemma): after attention, before and after the MLP.
SANDWICH_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, by Hugging Face name, with its shape."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    norms = ("input_layernorm", *SANDWICH_NORMS) if c.norm_placement == "sandwich" else (
        "input_layernorm", "post_attention_layernorm")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for norm in norms:
            shapes[p + norm + ".weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def gguf_to_hf_name(
    name: str, layer_names: Mapping[str, str], global_names: Mapping[str, str]
) -> str | None:
    """The Hugging Face name of a GGUF tensor under a family's name maps, or None when it has none."""
    if name in global_names:
        return global_names[name]
    match = _GGUF_LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in layer_names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    return None
