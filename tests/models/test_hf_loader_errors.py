"""Bad Hugging Face directories fail with ModelLoadError naming the offending file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import parse_hf_config, read_hf_config
from protoserve.engine.loader.load import load_model


@pytest.fixture
def llama_dir(tiny_checkpoint, tmp_path: Path) -> Path:
    src, _ = tiny_checkpoint("llama")
    return Path(shutil.copytree(src, tmp_path / "llama"))


@pytest.fixture
def sharded_dir(tiny_checkpoint, tmp_path: Path) -> Path:
    src, _ = tiny_checkpoint("qwen2")
    return Path(shutil.copytree(src, tmp_path / "qwen2"))


def _load_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, progress=False)
    return info.value


def _edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_missing_config(llama_dir: Path) -> None:
    (llama_dir / "config.json").unlink()
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir / "config.json" and "missing" in err.problem


def test_config_not_json(llama_dir: Path) -> None:
    (llama_dir / "config.json").write_text("{not json")
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir / "config.json" and "JSON" in err.problem


def test_unknown_model_type(llama_dir: Path) -> None:
    _edit_config(llama_dir, model_type="gpt2")
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir / "config.json"
    assert "unknown model_type 'gpt2'" in err.problem and "llama" in err.problem


def test_unsupported_rope_type(llama_dir: Path) -> None:
    _edit_config(llama_dir, rope_parameters={"rope_type": "ntk-by-parts", "factor": 4.0, "rope_theta": 10000.0})
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir / "config.json" and "ntk-by-parts" in err.problem


def test_per_layer_type_rope_refused_where_the_family_has_one_rope(llama_dir: Path) -> None:
    _edit_config(llama_dir, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}})
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir / "config.json" and "per layer type" in err.problem


def test_missing_shard(sharded_dir: Path) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded_dir / shard).unlink()
    err = _load_error(sharded_dir)
    assert Path(err.path) == sharded_dir / shard and "missing shard" in err.problem


def test_wrong_tensor_shape(sharded_dir: Path) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = sharded_dir / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.zeros(64, 64)
    save_file(tensors, shard, metadata={"format": "pt"})
    err = _load_error(sharded_dir)
    assert Path(err.path) == shard
    assert name in err.problem and "[64, 64]" in err.problem and "[128, 64]" in err.problem


def test_missing_tensor(llama_dir: Path) -> None:
    file = llama_dir / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    err = _load_error(llama_dir)
    assert Path(err.path) == file and "model.layers.0.self_attn.k_proj.weight" in err.problem


def test_unexpected_tensor(llama_dir: Path) -> None:
    """A tensor the decoder has no place for (here an MLP bias) is an error, never silently dropped."""
    file = llama_dir / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    save_file(tensors, file, metadata={"format": "pt"})
    err = _load_error(llama_dir)
    assert Path(err.path) == file and "up_proj.bias" in err.problem


def test_corrupt_safetensors(llama_dir: Path) -> None:
    file = llama_dir / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    err = _load_error(llama_dir)
    assert Path(err.path) == file and "safetensors" in err.problem


def test_no_weights(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    err = _load_error(llama_dir)
    assert Path(err.path) == llama_dir and "safetensors" in err.problem


def test_missing_path(tmp_path: Path) -> None:
    err = _load_error(tmp_path / "nope")
    assert Path(err.path) == tmp_path / "nope"


def test_bad_options_are_value_errors(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama_dir, dtype="float16", progress=False)
    with pytest.raises(ValueError, match="quantization"):
        load_model(llama_dir, quantization="int2", progress=False)


def test_legacy_config_format_and_generation_eos(tmp_path: Path) -> None:
    """transformers 4 wrote rope_theta/rope_scaling at top level; generation_config.json eos wins."""
    raw = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    cfg = read_hf_config(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0
    assert cfg.eos_token_ids == [128001, 128009] and cfg.bos_token_id == 1
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and not cfg.tie_word_embeddings
    assert parse_hf_config({**raw, "eos_token_id": [5, 6]}, None, tmp_path).eos_token_ids == [5, 6]
