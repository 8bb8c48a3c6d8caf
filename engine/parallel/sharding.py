"""Shard a loaded Decoder in place for rank ``rank`` of ``world_size`` (Megatron-style), as the
rank's ShardPlan says (engine/parallel/shard_plan.py: which heads split and which replicate).

Per layer:

* ``qkv_proj`` is column-parallel: the rank keeps its query heads and its KV heads (the fused
  weight's rows are ``[q | k | v]``; each part is sliced, bias included). KV heads replicated
  over several ranks keep the same rows on each. Per-head q/k norms are the same for every head
  and stay whole.
* ``o_proj`` is row-parallel: the input columns of the rank's query heads, then an all-reduce
  (``RowParallel``), the bias added once to the sum.
* ``gate_up_proj`` is column-parallel with its gate and up halves sliced alike, so the local
  weight stays ``[gate_local | up_local]``; ``down_proj`` is row-parallel + all-reduce. An ungated
  GELU MLP (StarCoder2) splits the same way: ``c_fc`` by rows, ``c_proj`` row-parallel.
* Embeddings, every norm and the LM head are replicated: each rank computes the same hidden
  states and full logits (only rank 0's are used).

The model's config becomes the local one (the rank's heads, KV heads and intermediate size) so
that each rank's KV cache holds only its own KV heads; ``model.tensor_parallel`` records the
plan. Sharded models run on the module path: the fused C++ step is one rank's. MoE layers are
not sharded (tensor parallelism of experts is not built) and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from protoserve.engine.models.decoder import Decoder
from protoserve.engine.parallel.linear_slices import layer_bias, take_columns, take_rows
from protoserve.engine.parallel.row_parallel import RowParallel
from protoserve.engine.parallel.shard_plan import plan_shard


def _rows(units: range, width: int, offset: int = 0) -> torch.Tensor:
    """Output rows of ``units`` (heads of ``width`` rows, or single channels) in a projection whose
    part for them starts at row ``offset``."""
    return torch.arange(offset + units.start * width, offset + units.stop * width)


def _mlp_shards(mlp: nn.Module, gate_up_rows: torch.Tensor, inter: range, p: str) -> tuple[nn.Module, nn.Module]:
    """The rank's (input, output) projections of one MLP: gate_up / down, or an ungated GELU MLP's
    c_fc / c_proj (StarCoder2), whose input rows are the rank's intermediate units alone."""
    if hasattr(mlp, "c_fc"):
        return (take_rows(mlp.c_fc, _rows(inter, 1), p + "mlp.c_fc"),
                RowParallel(take_columns(mlp.c_proj, inter.start, inter.stop, p + "mlp.c_proj"),
                            layer_bias(mlp.c_proj)))
    return (take_rows(mlp.gate_up_proj, gate_up_rows, p + "mlp.gate_up_proj"),
            RowParallel(take_columns(mlp.down_proj, inter.start, inter.stop, p + "mlp.down_proj"),
                        layer_bias(mlp.down_proj)))


def shard_decoder(model: Decoder, rank: int, world_size: int) -> None:
    """Keep rank's shard of every attention and MLP in ``model`` (see the module docstring).

    Call after quantization and before ``pack_for_kernels``. Raises ValueError (naming the field)
    when the model cannot be split so; the model is then untouched.
    """
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the model is already sharded")
    config = model.config
    plan = plan_shard(config, rank, world_size)
    if world_size == 1:
        return
    d = config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    qkv_rows = torch.cat([_rows(plan.q_heads, d), _rows(plan.kv_heads, d, q_size),
                          _rows(plan.kv_heads, d, q_size + kv_size)])
    inter = plan.intermediate
    gate_up_rows = torch.cat([_rows(inter, 1), _rows(inter, 1, config.intermediate_size)])
    q_cols = (plan.q_heads.start * d, plan.q_heads.stop * d)
    # Slice every layer first, assign after: a refused layer (an int4 shape) leaves the model whole.
    sliced = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"layers.{i}."
        sliced.append((
            take_rows(attn.qkv_proj, qkv_rows, p + "self_attn.qkv_proj"),
            RowParallel(take_columns(attn.o_proj, *q_cols, p + "self_attn.o_proj"),
                        layer_bias(attn.o_proj)),
            *_mlp_shards(mlp, gate_up_rows, inter, p),
        ))
    local = plan.local_config(config)
    for layer, (qkv, o, gate_up, down) in zip(model.layers, sliced, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = qkv, o
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        if hasattr(mlp, "c_fc"):
            mlp.c_fc, mlp.c_proj = gate_up, down
        else:
            mlp.gate_up_proj, mlp.down_proj = gate_up, down
        mlp.intermediate_size = local.intermediate_size
    model.config = local
    model.fused_step = None  # bound to the unsharded weights; the sharded model runs module by module
    model.tensor_parallel = plan
