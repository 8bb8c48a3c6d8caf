"""Shard a loaded Decoder in place for rank ``rank`` of ``world_size`` (Megatron-style).

Per layer:

* ``qkv_proj`` is column-parallel: the rank keeps its query heads and its KV heads (the fused
  weight's rows are ``[q | k | v]``; each part is sliced, bias included). Per-head q/k norms are
  the same for every head and stay whole.
* ``o_proj`` is row-parallel: the input columns of the rank's query heads, then an all-reduce
  (``RowParallel``), the bias added once to the sum.
* ``gate_up_proj`` is column-parallel with its gate and up halves sliced alike, so the local
  weight stays ``[gate_local | up_local]``; ``down_proj`` is row-parallel + all-reduce.
* Embeddings, every norm and the LM head are replicated: each rank computes the same hidden
  states and full logits (only rank 0's are used).

The model's config becomes the local one (heads, KV heads and intermediate size divided by the
world size) so that each rank's KV cache holds only its own heads; ``model.tensor_parallel``
records the shard. Sharded models run on the module path: the fused C++ step is one rank's.
MoE layers are not sharded (tensor parallelism of experts is not built) and are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.decoder import Decoder
from protoserve.engine.parallel.linear_slices import layer_bias, take_columns, take_rows
from protoserve.engine.parallel.row_parallel import RowParallel


@dataclass(frozen=True)
class ShardInfo:
    """Which shard of the model this process holds."""

    rank: int
    world_size: int


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the field when ``config`` cannot be split over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world_size}")
    if config.num_experts > 0:
        raise ValueError(f"tensor_parallel_size {world_size}: {config.architecture} has MoE layers "
                         f"(num_experts={config.num_experts}), and tensor parallelism of MoE layers is not built")
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {field} ({value})")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's layers and KV cache have."""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def _part(start: int, size: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices of rank's share of ``[start, start + size)``."""
    share = size // world_size
    return torch.arange(start + rank * share, start + (rank + 1) * share)


def shard_decoder(model: Decoder, rank: int, world_size: int) -> None:
    """Keep rank's shard of every attention and MLP in ``model`` (see the module docstring).

    Call after quantization and before ``pack_for_kernels``. Raises ValueError (naming the field)
    when the model cannot be split so; the model is then untouched.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    config = model.config
    check_shardable(config, world_size)
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the model is already sharded")
    if world_size == 1:
        return
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    qkv_rows = torch.cat([_part(0, q_size, rank, world_size), _part(q_size, kv_size, rank, world_size),
                          _part(q_size + kv_size, kv_size, rank, world_size)])
    gate_up_rows = torch.cat([_part(0, inter, rank, world_size), _part(inter, inter, rank, world_size)])
    q_cols, inter_cols = q_size // world_size, inter // world_size
    # Slice every layer first, assign after: a refused layer (an int4 shape) leaves the model whole.
    sliced = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"layers.{i}."
        sliced.append((
            take_rows(attn.qkv_proj, qkv_rows, p + "self_attn.qkv_proj"),
            RowParallel(take_columns(attn.o_proj, rank * q_cols, (rank + 1) * q_cols, p + "self_attn.o_proj"),
                        layer_bias(attn.o_proj)),
            take_rows(mlp.gate_up_proj, gate_up_rows, p + "mlp.gate_up_proj"),
            RowParallel(take_columns(mlp.down_proj, rank * inter_cols, (rank + 1) * inter_cols, p + "mlp.down_proj"),
                        layer_bias(mlp.down_proj)),
        ))
    local = local_config(config, world_size)
    for layer, (qkv, o, gate_up, down) in zip(model.layers, sliced, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = qkv, o
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        mlp.gate_up_proj, mlp.down_proj = gate_up, down
        mlp.intermediate_size = local.intermediate_size
    model.config = local
    model.fused_step = None  # bound to the unsharded weights; the sharded model runs module by module
    model.tensor_parallel = ShardInfo(rank, world_size)
