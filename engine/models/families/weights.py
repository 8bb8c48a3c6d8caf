"""The tensors a ModelConfig needs, by Hugging Face name and shape, and GGUF names onto them.

Shared by every dense family: the blocks in ModelConfig (biases, q/k norm,
norm kind and placement, MLP kind) decide which tensors exist, so a family declares no list of
its own. A family with other blocks (an MoE MLP) sets ``Family.hf_shapes`` to
its own function of the same signature.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from protoserve.engine.models.config import ModelConfig

# Norms of a "sandwich" layer besides input_layernorm (Gemma): after attention, before and after the MLP.
SANDWICH_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# transformers' names of an MLP without a gate (StarCoder2, as GPT-2 named them): up, then down.
GELU_MLP = ("c_fc", "c_proj")

_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def layer_norm_names(config: ModelConfig) -> tuple[str, ...]:
    """The norms of each layer, by Hugging Face name, as the config's norm placement puts them."""
    if config.norm_placement == "sandwich":
        return ("input_layernorm", *SANDWICH_NORMS)
    if config.norm_placement == "parallel":
        return ("input_layernorm",)
    return ("input_layernorm", "post_attention_layernorm")


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, by Hugging Face name, with its shape."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    shapes.update(_norm_shapes(c, "model.norm"))
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for norm in layer_norm_names(c):
            shapes.update(_norm_shapes(c, p + norm))
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
        shapes.update(_mlp_shapes(c, p + "mlp."))
    return shapes


def _norm_shapes(c: ModelConfig, name: str) -> dict[str, tuple[int, ...]]:
    if c.norm_bias:
        return {f"{name}.weight": (c.hidden_size,), f"{name}.bias": (c.hidden_size,)}
    return {f"{name}.weight": (c.hidden_size,)}


def mlp_projections(config: ModelConfig) -> tuple[str, ...]:
    """The MLP's projections by Hugging Face name: input side first, the down projection last."""
    return GELU_MLP if config.mlp == "gelu" else ("gate_proj", "up_proj", "down_proj")


def _mlp_shapes(c: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    *inputs, down = mlp_projections(c)
    for name in inputs:
        shapes[f"{prefix}{name}.weight"] = (c.intermediate_size, c.hidden_size)
        if c.mlp_bias:
            shapes[f"{prefix}{name}.bias"] = (c.intermediate_size,)
    shapes[f"{prefix}{down}.weight"] = (c.hidden_size, c.intermediate_size)
    if c.mlp_bias:
        shapes[f"{prefix}{down}.bias"] = (c.hidden_size,)
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
        suffix = layer_names[part]  # "{kind}" in it: the name ends in the kind its own way (DeepSeek's _bias)
        return f"model.layers.{layer}.{suffix.format(kind=kind) if '{kind}' in suffix else f'{suffix}.{kind}'}"
    return None
