"""--quantization auto: a checkpoint is served at the precision it is stored in."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_checkpoint import hf_weights, write_gguf

from protoserve.engine.loader.auto_quantization import mode_for_gguf_tensors, mode_for_type
from protoserve.engine.loader.gguf_checkpoint import load_gguf_checkpoint
from protoserve.engine.loader.load import load_model
from protoserve.kernels.cpu import packed_linear


@pytest.mark.parametrize(
    ("type_name", "mode"),
    [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q5_0", "int8"), ("Q6_K", "int8"),
     ("Q8_0", "int8"), ("F16", "none"), ("BF16", "none"), ("F32", "none")],
)  # fmt: skip
def test_each_storage_type_maps_to_a_mode_that_holds_it(type_name: str, mode: str) -> None:
    assert mode_for_type(type_name) == mode


def test_the_linear_layers_decide_and_the_widest_wins() -> None:
    q4 = [(f"blk.{i}.{t}.weight", "Q4_1") for i in range(2) for t in ("attn_q", "attn_output", "ffn_down")]
    others = [("token_embd.weight", "Q8_0"), ("blk.0.attn_norm.weight", "F32"), ("output_norm.weight", "F32")]
    assert mode_for_gguf_tensors(q4 + others) == "int4"  # embedding and norms are not linear layers
    assert mode_for_gguf_tensors(q4 + [("blk.1.ffn_down.weight", "Q6_K")]) == "int8"  # Q4_K_M-style mix
    assert mode_for_gguf_tensors(q4 + [("blk.1.attn_v.weight", "F16")]) == "none"
    assert mode_for_gguf_tensors(others) == "none"


@pytest.mark.parametrize(
    ("quantize", "mode"), [(GGMLQuantizationType.Q4_1, "int4"), (GGMLQuantizationType.Q8_0, "int8"), (None, "none")]
)
def test_gguf_files_load_at_their_stored_precision(tmp_path, quantize, mode: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_weights(5), permute=True, quantize=quantize)
    assert load_model(path, quantization="auto", progress=False, load_tokenizer=False).quantization == mode


@pytest.mark.skipif(not packed_linear.available(), reason="the CPU kernels do not build on this CPU")
def test_a_q4_1_file_is_served_with_its_own_weights(tmp_path) -> None:
    """The int4 layers' packed weights are the file's Q4_1 weights, not a requantization of them."""
    path = write_gguf(tmp_path / "q41.gguf", "llama", hf_weights(6), permute=True, quantize=GGMLQuantizationType.Q4_1)
    _, stored = load_gguf_checkpoint(path, progress=False)  # dequantized (and Q/K un-permuted) float32
    model = load_model(path, quantization="auto", progress=False, load_tokenizer=False).model
    for i, layer in enumerate(model.layers):
        served = packed_linear.unpack(layer.mlp.down_proj.packed)
        assert torch.equal(served, stored[f"model.layers.{i}.mlp.down_proj.weight"])
        gate_up = packed_linear.unpack(layer.mlp.gate_up_proj.packed)
        expected = torch.cat([stored[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(gate_up, expected)


def test_auto_keeps_8_bits_where_int4_groups_do_not_fit(tmp_path) -> None:
    # Groups of 64 do not divide the down projection's 96 inputs: int4 is refused, int8 still holds Q4_1.
    path = write_gguf(tmp_path / "q4.gguf", "llama", hf_weights(7), permute=True, quantize=GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="does not divide"):
        load_model(path, quantization="int4", group_size=64, progress=False, load_tokenizer=False)
    loaded = load_model(path, quantization="auto", group_size=64, progress=False, load_tokenizer=False)
    assert loaded.quantization == "int8"
    # A group size int4 never takes is the caller's mistake, not a reason to fall back.
    with pytest.raises(ValueError, match="group size must be one of"):
        load_model(path, quantization="auto", group_size=48, progress=False, load_tokenizer=False)


def test_a_hugging_face_directory_is_served_unquantized(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(tmp_path, quantization="auto", progress=False).quantization == "none"


def test_the_default_smollm2_gguf_is_served_int4() -> None:
    loaded = load_model(None, quantization="auto", progress=False)
    assert (loaded.quantization, loaded.group_size) == ("int4", 32)
