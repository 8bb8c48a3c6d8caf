"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> tensors.

A directory holds ``config.json``, the weights as one ``model.safetensors`` or
as shards listed in ``model.safetensors.index.json``, and optionally
``generation_config.json`` (whose ``eos_token_id`` wins over config.json's). A GPTQ/AWQ
``quantization_config`` is parsed here; engine/loader/packed_checkpoint.py reads its packed layers.
Tensor headers are checked against the shapes the decoder expects before any
data is read; data is read through ``safetensors.safe_open`` (memory-mapped).
Every problem raises ModelLoadError naming the offending file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_fields import HFFields
from protoserve.engine.loader.progress import tensor_progress
from protoserve.engine.loader.quantization_config import PackedQuantization, parse_quantization_config
from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Tensors some checkpoints carry that the decoder recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class HFCheckpoint:
    """A parsed model directory: the config and where each tensor lives."""

    path: Path
    config: ModelConfig
    weight_files: dict[str, Path]  # tensor name -> safetensors file
    index_path: Path  # the file that lists the tensors (index json or the single safetensors file)
    quantization: PackedQuantization | None = None  # GPTQ/AWQ packed linear layers


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(path, "missing: a Hugging Face model directory needs this file")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def parse_hf_config(raw: Mapping[str, Any], generation: Mapping[str, Any] | None, path: Path) -> ModelConfig:
    """config.json (+ generation_config.json) -> ModelConfig through the family its model_type names;
    ModelLoadError(path, ...) when unusable."""
    model_type = raw.get("model_type")
    if model_type not in families.HF_MODEL_TYPES:
        raise ModelLoadError(
            path,
            f"unknown model_type {model_type!r}; supported model types: {', '.join(sorted(families.HF_MODEL_TYPES))}",
        )
    config = families.for_hf_model_type(model_type).config_from_hf(HFFields(raw, generation, path))
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            path, f"num_attention_heads {config.num_heads} is not a multiple of num_key_value_heads"
        )
    return config


def read_hf_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    d = Path(model_dir)
    raw = _read_json(d / CONFIG_FILE, required=True)
    generation = _read_json(d / GENERATION_CONFIG_FILE, required=False)
    assert raw is not None
    return parse_hf_config(raw, generation, d / CONFIG_FILE)


def read_generation_config(model_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The directory's ``generation_config.json``, or None when it has none."""
    return _read_json(Path(model_dir) / GENERATION_CONFIG_FILE, required=False)


def open_hf_checkpoint(model_dir: str | os.PathLike[str]) -> HFCheckpoint:
    """Parse the config and map every tensor name to its safetensors file (headers only)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelLoadError(d, "not a directory (expected a Hugging Face model directory or a .gguf file)")
    config = read_hf_config(d)
    quantization = parse_quantization_config(_read_json(d / CONFIG_FILE, required=True) or {}, d / CONFIG_FILE)
    index = d / INDEX_FILE
    files: dict[str, Path] = {}
    if index.is_file():
        data = _read_json(index, required=True) or {}
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "no 'weight_map' object")
        for name, shard in weight_map.items():
            files[name] = d / shard
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(shard, f"missing shard listed in {INDEX_FILE}")
        listing = index
    else:
        shards = sorted(d.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(d, "no *.safetensors weights in the directory")
        for shard in shards:
            for name in _header_names(shard):
                files[name] = shard
        listing = d / SINGLE_FILE if (d / SINGLE_FILE).is_file() else d
    return HFCheckpoint(d, config, files, listing, quantization)


def _header_names(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _mtp_prefixes(config: ModelConfig) -> tuple[str, ...]:
    """The names' prefixes of the checkpoint's multi-token-prediction layers, stored after the last layer."""
    first = config.num_layers
    return tuple(f"model.layers.{i}." for i in range(first, first + config.num_mtp_layers))


def load_hf_tensors(
    ckpt: HFCheckpoint,
    expected: Mapping[str, tuple[int, ...]],
    progress: bool = True,
    int32_names: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Check names and shapes against ``expected`` (headers only), then read the tensors: float ones,
    but int32 for ``int32_names`` (packed codes)."""
    tied_extra = {"lm_head.weight"} if ckpt.config.tie_word_embeddings else set()
    unserved = _mtp_prefixes(ckpt.config)
    skipped = 0
    for name, file in ckpt.weight_files.items():
        if unserved and name.startswith(unserved):
            skipped += 1
        elif name not in expected and name not in tied_extra and not name.endswith(IGNORED_SUFFIXES):
            raise ModelLoadError(file, f"unexpected tensor {name!r} for a {ckpt.config.architecture} model")
    if skipped:
        log.info("%s: skipped the %d tensors of its %d multi-token-prediction layer(s) (num_nextn_predict_layers); "
                 "they only draft, and are not served", ckpt.path, skipped, ckpt.config.num_mtp_layers)
    missing = [n for n in expected if n not in ckpt.weight_files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(ckpt.index_path, f"missing tensor {missing[0]!r}{more}")

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(ckpt.weight_files[name], []).append(name)
    # Every header first, so a bad shape is reported before gigabytes are read.
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ModelLoadError(file, f"tensor {name!r} listed in {INDEX_FILE} is not in this shard")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise ModelLoadError(
                        file, f"tensor {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                    )

    out: dict[str, torch.Tensor] = {}
    with tensor_progress(total=len(expected), desc=f"Loading {ckpt.path.name}", enabled=progress) as bar:
        for file, names in by_file.items():
            with _open(file) as f:
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise ModelLoadError(file, f"cannot read tensor {name!r}: {e}") from e
                    if name in int32_names:
                        if tensor.dtype != torch.int32:
                            raise ModelLoadError(file, f"tensor {name!r} has dtype {tensor.dtype}, expected torch.int32")
                    elif not tensor.is_floating_point():
                        raise ModelLoadError(
                            file, f"tensor {name!r} has dtype {tensor.dtype}, expected a float type"
                        )
                    out[name] = tensor
                    bar.update(1)
    return out


def _open(file: Path):
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ModelLoadError(file, f"unreadable safetensors file: {e}") from e
