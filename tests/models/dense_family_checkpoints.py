"""Tiny random checkpoints of Gemma 2, StarCoder2, Command-R and Phi-3/4, and GGUF files of them.

Each is saved with transformers' own classes and a byte-level tokenizer by
bench/tiny_checkpoints.py, as family_checkpoints.py's are; ``write_gguf`` writes the same weights as llama.cpp's
converter lays them out for the family's GGUF architecture (names, metadata keys,
Gemma's norms stored as ``1 + w``, Phi-3's longrope factors as tensors; none permutes q/k rows).

``phi3`` has longrope with a pretraining context (``PHI_ORIGINAL``) far below
max_position_embeddings, so prompts on either side of it take different factor sets,
and a sliding window; ``phi4-mini`` rotates 3/4 of each head (partial rotary), ties its
embeddings and has longrope too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from family_checkpoints import TINY, WINDOW
from torch import nn

from bench.tiny_checkpoints import random_model, save_checkpoint

FAMILIES = ("gemma2", "starcoder2", "command_r")
PHI_FAMILIES = ("phi3", "phi4-mini")
PHI_ORIGINAL = 48  # original_max_position_embeddings: longrope's short factors up to here
PHI_WINDOW = 24
# Small enough that the soft-cap bends the random model's scores (guarded by a test).
ATTN_SOFTCAP = 5.0


def hf_config(family: str):
    from transformers import CohereConfig, Gemma2Config, Starcoder2Config

    if family == "gemma2":  # local/global alternating, both soft-caps, sandwich norms, GeGLU
        # query_pre_attn_scalar = head_dim: llama.cpp's gemma2 scales by head_dim and writes no scalar
        # (a scalar other than head_dim goes through the same code in Gemma 3's tests).
        return Gemma2Config(
            **TINY, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            attn_logit_softcapping=ATTN_SOFTCAP, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "starcoder2":  # LayerNorm with biases, GELU MLP, biases everywhere, every layer slides
        return Starcoder2Config(**TINY, num_hidden_layers=2, sliding_window=WINDOW, use_bias=True,
                                hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, tie_word_embeddings=True)
    if family == "command_r":  # parallel block, interleaved rope, logit scale, tied embeddings
        return CohereConfig(**TINY, num_hidden_layers=2, logit_scale=0.5, use_qk_norm=False,
                            tie_word_embeddings=True)
    if family in PHI_FAMILIES:
        return _phi_config(family)
    raise ValueError(family)


def _longrope(pairs: int) -> dict:
    """Factor sets far enough apart that choosing the wrong one shows in the logits."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.6 * i for i in range(pairs)]}


def _phi_config(family: str):
    from transformers import Phi3Config

    base = dict(**TINY, num_hidden_layers=2, original_max_position_embeddings=PHI_ORIGINAL, rms_norm_eps=1e-5)
    if family == "phi3":  # head_dim 16: 8 rotary pairs
        return Phi3Config(**base, rope_scaling=_longrope(8), sliding_window=PHI_WINDOW)
    # head_dim 16 * 0.75: 12 rotary dims, 6 pairs
    return Phi3Config(**base, rope_scaling=_longrope(6), partial_rotary_factor=0.75, tie_word_embeddings=True)


def make_checkpoint(family: str, directory: Path, seed: int = 0) -> nn.Module:
    """Save a tiny random model of ``family`` (with a tokenizer) to ``directory``; return it (float32, eval)."""
    # Gemma's norms hold w of x * (1 + w).
    return save_checkpoint(random_model(hf_config(family), seed, 0.0 if family == "gemma2" else 1.0), directory)


# family -> (GGUF architecture, Hugging Face layer part -> llama.cpp's part)
_ATTENTION = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output"}
_GATED = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_FORMS = {
    "gemma2": ("gemma2", {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                          **_ATTENTION, **_GATED}),
    "starcoder2": ("starcoder2", {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                                  **_ATTENTION, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}),
    "command_r": ("command-r", {"input_layernorm": "attn_norm", **_ATTENTION, **_GATED}),
}
_PHI_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_FORMS.update({family: ("phi3", _PHI_PARTS) for family in PHI_FAMILIES})


def _metadata(writer, family: str, c) -> None:
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if family == "gemma2":
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_sliding_window(c.sliding_window)
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    elif family == "starcoder2":
        writer.add_layer_norm_eps(c.norm_epsilon)
        writer.add_sliding_window(c.sliding_window)  # llama.cpp's converter omits it; the loader honours it
    elif family in PHI_FAMILIES:
        _phi_metadata(writer, c, head_dim)
    else:
        writer.add_layer_norm_eps(c.layer_norm_eps)
        writer.add_logit_scale(c.logit_scale)


def _phi_metadata(writer, c, head_dim: int) -> None:
    """As llama.cpp's Phi3MiniModel writes them: the rotated dims, the original context, longrope's
    attention factor (transformers' formula), a window of 0 for none."""
    import math

    rope = c.rope_parameters
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    writer.add_sliding_window(c.sliding_window or 0)
    scale = c.max_position_embeddings / c.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))


def write_gguf(path: Path, hf: nn.Module, family: str, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """The tiny model in float32 as llama.cpp's converter writes ``family`` (tied: no ``output.weight``),
    plus the ``extra`` tensors by GGUF name (Phi's longrope factor tensors before them)."""
    import gguf
    from safetensors.torch import load_file

    arch, parts = GGUF_FORMS[family]
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, family, c)
    with tempfile.TemporaryDirectory() as saved:
        hf.save_pretrained(saved)
        state = {k: v for f in Path(saved).glob("*.safetensors") for k, v in load_file(f).items()}

    def put(gguf_name: str, hf_name: str) -> None:
        w = state.pop(hf_name)
        if family == "gemma2" and hf_name.endswith("norm.weight"):
            w = 1.0 + w  # llama.cpp stores Gemma's norms as 1 + w
        writer.add_tensor(gguf_name, w.numpy())

    put("token_embd.weight", "model.embed_tokens.weight")
    for kind in ("weight", "bias"):
        if f"model.norm.{kind}" in state:
            put(f"output_norm.{kind}", f"model.norm.{kind}")
    for i in range(c.num_hidden_layers):
        for hf_part, gguf_part in parts.items():
            for kind in ("weight", "bias"):
                if f"model.layers.{i}.{hf_part}.{kind}" in state:
                    put(f"blk.{i}.{gguf_part}.{kind}", f"model.layers.{i}.{hf_part}.{kind}")
    if not c.tie_word_embeddings:
        put("output.weight", "lm_head.weight")
    state.pop("lm_head.weight", None)  # tied to the embedding
    assert not state, sorted(state)
    if family in PHI_FAMILIES:
        rope = c.rope_parameters
        extra = {"rope_factors_long.weight": torch.tensor(rope["long_factor"]),
                 "rope_factors_short.weight": torch.tensor(rope["short_factor"]), **(extra or {})}
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
