"""GGUF checkpoints: config mapping, HF-named weights (against transformers), and ModelLoadError for bad files."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_reference import fast_gguf_parsing

from protoserve.engine.loader import default_model
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.gguf_checkpoint import (
    GGUFCheckpoint,
    llama3_rope_factors,
    load_gguf_checkpoint,
    open_gguf,
    unpermute_qk,
)


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF row order), copied as the reference."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# -- SmolLM2 against transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    return GGUFCheckpoint(default_model_path())


@pytest.fixture(scope="module")
def smollm2_weights(smollm2) -> dict[str, torch.Tensor]:
    return smollm2.load_weights(progress=False)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF loader: dequantizes, names and un-permutes independently of ours.

    It parses the file twice with gguf.GGUFReader; for speed only, that parse uses our
    reader (tests/gguf_reference.py).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    import accelerate  # noqa: F401  transformers needs it to load GGUF weights; installed by make install
    path = default_model_path()
    with fast_gguf_parsing():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_config_facts(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.intermediate_size, c.vocab_size, c.head_dim) == (1536, 49152, 64)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rope_scaling is None and c.sliding_window is None
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.bos_token_id == 1
    # <|im_end|> is the file's eos; <|endoftext|> is a control token llama.cpp also stops on.
    assert c.eos_token_ids == [2, 0]


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, hf_model):
    ours, ref = smollm2.config, hf_model.config
    assert ours.vocab_size == ref.vocab_size
    assert ours.hidden_size == ref.hidden_size
    assert ours.intermediate_size == ref.intermediate_size
    assert ours.num_layers == ref.num_hidden_layers
    assert ours.num_heads == ref.num_attention_heads
    assert ours.num_kv_heads == ref.num_key_value_heads
    assert ours.head_dim == ref.head_dim
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_weights, hf_model):
    """Tensor by tensor, exactly: this covers dequantization, naming and the Q/K un-permutation."""
    reference = hf_model.state_dict()
    # transformers lists the tied lm_head as a parameter; we omit it and set tie_word_embeddings.
    assert set(reference) - set(smollm2_weights) == {"lm_head.weight"}
    assert set(smollm2_weights) <= set(reference)
    mismatched = [name for name, w in smollm2_weights.items() if not torch.equal(w, reference[name])]
    assert mismatched == []


def test_smollm2_q_and_k_are_unpermuted(smollm2, smollm2_weights):
    """The HF q/k rows differ from the GGUF row order, and permuting them back gives the file's rows."""
    raw = {t.name: t for t in smollm2.reader.tensors}
    for gguf_name, hf_name, heads in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3),
    ):
        t = raw[gguf_name]
        file_rows = gguf.quants.dequantize(t.data, t.tensor_type)
        ours = smollm2_weights[hf_name].numpy()
        assert not np.array_equal(ours, file_rows)
        assert np.array_equal(llama_cpp_permute(ours, heads), file_rows)


def test_smollm2_weight_names_and_dtype(smollm2):
    names = smollm2.parameter_names
    assert len(names) == 1 + 1 + 30 * 9 and "lm_head.weight" not in names
    assert "model.layers.29.mlp.down_proj.weight" in names
    name, first = next(iter(smollm2.iter_weights(dtype=torch.bfloat16, progress=False)))
    assert name == "model.embed_tokens.weight" and first.dtype == torch.bfloat16
    assert tuple(first.shape) == (49152, 576)


# -- synthetic checkpoints --------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 40, 2


def hf_weights(seed: int, *, bias: bool = False, qk_norm: bool = False, head_dim: int = HEAD_DIM):
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q_rows, kv_rows = HEADS * head_dim, KV_HEADS * head_dim
    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(q_rows, HIDDEN),
            p + "self_attn.k_proj.weight": rand(kv_rows, HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv_rows, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, q_rows),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if bias:
            w |= {
                p + f"self_attn.{x}_proj.bias": rand(n)
                for x, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            }
        if qk_norm:
            w |= {
                p + "self_attn.q_norm.weight": rand(head_dim),
                p + "self_attn.k_norm.weight": rand(head_dim),
            }
    return w


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    *,
    permute: bool = False,
    quantize: GGMLQuantizationType | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    head_dim: int | None = None,
    metadata: dict[str, object] | None = None,
) -> Path:
    """A small GGUF the way llama.cpp's converter writes one (Q/K permuted for llama-family if asked)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
    for hf_name, array in weights.items():
        if permute and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, HEADS)
        elif permute and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, KV_HEADS)
        if quantize is not None and array.ndim == 2 and "proj" in hf_name:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(gguf_name(hf_name), array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_permuted_weights_come_back_in_hf_order(tmp_path):
    weights = hf_weights(0)
    path = write_gguf(tmp_path / "llama.gguf", "llama", weights, permute=True)
    config, loaded = load_gguf_checkpoint(path, progress=False)
    assert config.architecture == "llama" and config.tie_word_embeddings
    assert set(loaded) == set(weights)
    for name, array in weights.items():
        assert np.array_equal(loaded[name].numpy(), array), name


def test_mistral_is_unpermuted_too(tmp_path):
    weights = hf_weights(1) | {"lm_head.weight": np.ones((VOCAB, HIDDEN), np.float32)}
    path = write_gguf(
        tmp_path / "mistral.gguf",
        "mistral",
        weights,
        permute=True,
        metadata={"mistral.attention.sliding_window": 4096},
    )
    config, loaded = load_gguf_checkpoint(path, progress=False)
    assert config.architecture == "mistral" and config.sliding_window == 4096
    assert not config.tie_word_embeddings and "lm_head.weight" in loaded
    assert np.array_equal(
        loaded["model.layers.1.self_attn.k_proj.weight"].numpy(),
        weights["model.layers.1.self_attn.k_proj.weight"],
    )


def test_quantized_linears_are_dequantized(tmp_path):
    weights = hf_weights(2)
    path = write_gguf(
        tmp_path / "q8.gguf", "llama", weights, permute=True, quantize=GGMLQuantizationType.Q8_0
    )
    _, loaded = load_gguf_checkpoint(path, progress=False)
    up = weights["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(up, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    )
    assert np.array_equal(loaded["model.layers.0.mlp.up_proj.weight"].numpy(), expected)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(loaded["model.layers.0.self_attn.q_proj.weight"].numpy() - q).max() < 0.05


def test_qwen2_biases_and_no_permutation(tmp_path):
    weights = hf_weights(3, bias=True)
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", weights)
    config, loaded = load_gguf_checkpoint(path, progress=False)
    assert config.architecture == "qwen2" and config.attention_bias and not config.qk_norm
    assert set(loaded) == set(weights)
    for name, array in weights.items():
        assert np.array_equal(loaded[name].numpy(), array), name


def test_qwen3_qk_norm_and_explicit_head_dim(tmp_path):
    weights = hf_weights(4, qk_norm=True, head_dim=32)  # head_dim != hidden / heads, as in Qwen3
    path = write_gguf(tmp_path / "qwen3.gguf", "qwen3", weights, head_dim=32)
    config, loaded = load_gguf_checkpoint(path, progress=False)
    assert config.qk_norm and config.head_dim == 32 and not config.attention_bias
    assert tuple(loaded["model.layers.0.self_attn.q_proj.weight"].shape) == (HEADS * 32, HIDDEN)
    for name, array in weights.items():
        assert np.array_equal(loaded[name].numpy(), array), name


def test_config_metadata_mapping(tmp_path):
    path = write_gguf(
        tmp_path / "yarn.gguf",
        "qwen2",
        hf_weights(5, bias=True),
        metadata={
            "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768,
        },
    )
    config = GGUFCheckpoint(path).config
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert config.rope_theta == 500000.0 and config.max_position_embeddings == 2048
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.head_dim == HIDDEN // HEADS
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    factors = llama3_rope_factors(500000.0, HEAD_DIM, 32.0, 1.0, 4.0, 8192)
    assert factors.min() == 1.0 and factors.max() == 32.0  # both ends of the ramp are present
    path = write_gguf(
        tmp_path / "llama32.gguf",
        "llama",
        hf_weights(6),
        permute=True,
        extra_tensors={"rope_freqs.weight": factors},
    )
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in checkpoint.parameter_names


def test_unknown_rope_freqs_are_rejected(tmp_path):
    factors = np.linspace(1.0, 3.0, HEAD_DIM // 2).astype(np.float32)
    path = write_gguf(
        tmp_path / "odd.gguf", "llama", hf_weights(6), extra_tensors={"rope_freqs.weight": factors}
    )
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        GGUFCheckpoint(path)


def test_unpermute_inverts_llama_cpp_permute_for_weights_and_biases():
    rng = np.random.default_rng(9)
    for heads, shape in ((9, (576, 8)), (3, (192,))):
        original = rng.standard_normal(shape).astype(np.float32)
        restored = unpermute_qk(torch.from_numpy(llama_cpp_permute(original, heads)), heads)
        assert np.array_equal(restored.numpy(), original)


# -- errors -----------------------------------------------------------------------------------------


def assert_load_error(path: Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        GGUFCheckpoint(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_file(tmp_path):
    assert_load_error(tmp_path / "nope.gguf", "no such file")


def test_directory_is_not_a_checkpoint(tmp_path):
    assert_load_error(tmp_path, "not a regular file")


def test_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_load_error(path, "not a readable GGUF")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert_load_error(path)


@pytest.mark.parametrize("keep", [0.999, 0.003], ids=["inside-tensor-data", "inside-metadata"])
def test_truncated_smollm2_copy(tmp_path, keep):
    source = default_model_path()
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as src:
        path.write_bytes(src.read(int(source.stat().st_size * keep)))
    assert_load_error(path)


def test_truncated_gguf_header_magic_ok(tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 7)
    assert_load_error(path, "not a readable GGUF")


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", hf_weights(7))
    assert_load_error(path, "unsupported architecture 'gpt2'")


def test_shape_mismatch(tmp_path):
    weights = hf_weights(8)
    weights["model.layers.1.mlp.up_proj.weight"] = np.zeros((FFN + 1, HIDDEN), np.float32)
    path = write_gguf(tmp_path / "bad_shape.gguf", "llama", weights)
    assert_load_error(path, "blk.1.ffn_up.weight", "shape (97, 64)", "expected (96, 64)")


def test_missing_tensor(tmp_path):
    weights = hf_weights(10)
    del weights["model.layers.0.self_attn.v_proj.weight"]
    path = write_gguf(tmp_path / "missing.gguf", "llama", weights)
    assert_load_error(path, "missing tensors", "model.layers.0.self_attn.v_proj.weight")


def test_unexpected_tensor(tmp_path):
    path = write_gguf(
        tmp_path / "fused.gguf",
        "llama",
        hf_weights(11),
        extra_tensors={"blk.0.attn_qkv.weight": np.zeros((4, 64), np.float32)},
    )
    assert_load_error(path, "unexpected tensor 'blk.0.attn_qkv.weight'")


def test_missing_required_metadata(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "nometa.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_load_error(tmp_path / "nometa.gguf", "missing metadata key llama.")


# -- default model ----------------------------------------------------------------------------------


def test_default_model_path_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_missing_package(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "no_such_model_package")
    with pytest.raises(ModelLoadError, match="no_such_model_package"):
        default_model_path()


def test_fast_reader_parses_like_the_stock_reader(tmp_path):
    """open_gguf's faster metadata parsing yields exactly what gguf.GGUFReader yields."""
    writer = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    writer.add_string("general.name", "tést ✓")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_float32("llama.rope.freq_base", 1e6)
    writer.add_uint64("some.count", 2**40)
    writer.add_int32("some.signed", -5)
    writer.add_array("tokenizer.ggml.tokens", ["a", "ĠHello", "<|im_start|>", "😀", ""])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 0.0, 3.5])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 3, 1, 6])
    writer.add_array("tokenizer.ggml.merges", [])
    writer.add_array("some.flags", [True, False])
    writer.add_array("some.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor(
        "q8.weight",
        gguf.quants.quantize(np.ones((2, 32), np.float32), GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fast, stock = open_gguf(tmp_path / "meta.gguf"), gguf.GGUFReader(tmp_path / "meta.gguf")
    assert list(fast.fields) == list(stock.fields)
    for key, want in stock.fields.items():
        got = fast.fields[key]
        assert (got.offset, got.name, got.types, got.data) == (want.offset, want.name, want.types, want.data), key
        assert got.contents() == want.contents(), key
        assert [got.contents(i) for i in range(len(want.data))] == [want.contents(i) for i in range(len(want.data))]
        # Arrays' parts are the reader's own (not numpy slices of the map), with the same sizes and values.
        assert [int(p.nbytes) for p in got.parts] == [int(p.nbytes) for p in want.parts], key
        assert [bytes(p) for p in got.parts] == [bytes(p) for p in want.parts], key
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors
    ]
    for a, b in zip(fast.tensors, stock.tensors, strict=True):
        assert np.array_equal(a.data, b.data)
