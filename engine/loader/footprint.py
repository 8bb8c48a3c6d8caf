"""A model's memory before it loads: its weights as served (after quantization) and its KV pool.

What a server checks against its memory budget before loading a model at run time: reading the
checkpoint's config and tensor index only, no weight. The weights are counted from the family's
tensor shapes (``families.hf_shapes``) at the precision the loader would serve them in: the decoder's
linear layers at the quantization mode (``auto`` resolved as load_model does), with an int8 LM head
under any quantized mode, everything else (embeddings, norms) in the activation dtype. It is an
estimate of the loaded ``Decoder.weight_bytes()``, within a few percent (CPU kernel packs and rope
tables aside).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from protoserve.engine.config import DEFAULT_INT4_GROUP_SIZE, EngineConfig, resolve_num_blocks
from protoserve.engine.loader.auto_quantization import AUTO, mode_for_gguf_tensors
from protoserve.engine.loader.catalogue import resolve_model
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import open_hf_checkpoint
from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.kv_cache import PagedKVCache, resolve_kv_dtype

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Per value of a quantized linear: int4 packs two codes a byte with a float16 scale and min per group;
# int8 one byte with a float32 scale per output row (added separately); fp8 one byte.
_CODE_BYTES = {"int4": 0.5, "int8": 1.0, "fp8": 1.0}


@dataclass(frozen=True)
class Footprint:
    """Bytes a model will hold once served."""

    weight_bytes: int
    kv_pool_bytes: int
    kv_blocks: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes


def estimate_footprint(
    source: str | os.PathLike[str] | None, dtype: str, quantization: str, config: EngineConfig
) -> Footprint:
    """The weights and KV pool ``source`` (a catalogue name, file or directory) would take served with
    ``dtype``, ``quantization`` and ``config``; ModelLoadError when the checkpoint cannot be read."""
    path = resolve_model(source).path
    if path.is_dir():
        ckpt = open_hf_checkpoint(path)
        model_config = ckpt.config
        stored = "none" if ckpt.quantization is None else "int4"
    elif path.is_file():
        from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint

        gguf = GGUFCheckpoint(path)  # metadata and tensor index only
        model_config = gguf.config
        stored = mode_for_gguf_tensors((t.name, t.tensor_type.name) for t in gguf.reader.tensors)
    else:
        raise ModelLoadError(path, "no such file or directory")
    mode = stored if quantization == AUTO else quantization
    weights = weight_bytes(model_config, dtype, mode, config.quant_group_size)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, getattr(torch, dtype), mode)
    block_bytes = PagedKVCache.model_block_bytes(model_config, config.block_size, kv_dtype)
    blocks = resolve_num_blocks(config, block_bytes)
    return Footprint(weight_bytes=weights, kv_pool_bytes=blocks * block_bytes, kv_blocks=blocks)


def weight_bytes(config: ModelConfig, dtype: str, mode: str, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """Bytes of ``config``'s weights with its linear layers in ``mode`` and the rest in ``dtype``."""
    float_bytes = _DTYPE_BYTES[dtype]
    shapes = families.hf_shapes(config)
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if mode != "none" and _is_decoder_linear(name, shape):
            total += _quantized_bytes(mode, shape, group_size)
        else:
            total += numel * float_bytes
    if mode != "none":
        # The LM head is served int8 (a tied one beside the float embedding table the lookup keeps).
        rows, cols = config.vocab_size, config.hidden_size
        tied = "lm_head.weight" not in shapes
        total += rows * cols + rows * 4 - (0 if tied else rows * cols * float_bytes)
    return total


def _is_decoder_linear(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and ".layers." in name and "embed" not in name and name.endswith("proj.weight")


def _quantized_bytes(mode: str, shape: tuple[int, ...], group_size: int) -> int:
    rows, cols = shape
    codes = int(rows * cols * _CODE_BYTES[mode])
    if mode == "int4":
        return codes + rows * (cols // group_size) * 4
    return codes + rows * 4
