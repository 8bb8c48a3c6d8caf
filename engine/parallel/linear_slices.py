"""Slices of one linear layer's weights, in whatever format it is stored (float, int8, int4).

Tensor parallelism keeps, per rank, some output channels of a column-parallel layer
(``take_rows``) or some input columns of a row-parallel one (``take_columns``). The
slices are taken from a layer's final, quantized form: int8 keeps each output channel's
scale and int4 each group's scale and min, so a rank holds exactly the codes the
unsharded model would serve (quantizing each rank's slice instead would give a
row-parallel int8 layer other per-channel scales, and a different model). Layers must
not yet be packed for the CPU kernel: the pack is a copy of the whole weight.
"""

from __future__ import annotations

import torch
from torch import nn

from protoserve.engine.models.linear import (
    INT4_N_MULTIPLE,
    Int4Linear,
    Int8Linear,
    KernelPackable,
    Linear,
    _torch_int4_form,
)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A compact copy, so the unsharded tensor the slice came from can be freed."""
    return t.clone(memory_format=torch.contiguous_format)


def _check_unpacked(layer: nn.Module, name: str) -> None:
    if isinstance(layer, KernelPackable) and layer.packed is not None:
        raise ValueError(f"{name} is already packed for the CPU kernel: shard the model before pack_for_kernels")


def take_rows(layer: nn.Module, rows: torch.Tensor, name: str) -> nn.Module:
    """The layer restricted to output channels ``rows`` (int64 indices), bias included."""
    _check_unpacked(layer, name)
    if isinstance(layer, Linear):
        out = Linear(layer.in_features, len(rows), bias=layer.bias is not None, dtype=layer.weight.dtype)
        out.weight = nn.Parameter(_own(layer.weight.detach()[rows]), requires_grad=False)
        if layer.bias is not None:
            out.bias = nn.Parameter(_own(layer.bias.detach()[rows]), requires_grad=False)
        out.deterministic = layer.deterministic
        return out
    bias = None if layer.bias is None else _own(layer.bias[rows])
    if isinstance(layer, Int8Linear):
        return Int8Linear(_own(layer.weight_int8[rows]), _own(layer.scales[rows]), bias, layer.out_dtype)
    if isinstance(layer, Int4Linear):
        q, scales, mins = _int4_form(layer, name)
        if len(rows) % INT4_N_MULTIPLE:
            raise ValueError(f"{name}: int4 packing needs a multiple of {INT4_N_MULTIPLE} output channels per "
                             f"rank, a shard has {len(rows)}")
        return _int4_layer(layer, q[rows], scales[rows], mins[rows], layer.in_features, bias)
    raise ValueError(f"{name}: tensor parallelism cannot shard a {type(layer).__name__}")


def take_columns(layer: nn.Module, start: int, stop: int, name: str) -> nn.Module:
    """The layer restricted to input columns ``[start, stop)``, without its bias (the caller adds it
    once, after the ranks' partial products are summed)."""
    _check_unpacked(layer, name)
    if isinstance(layer, Linear):
        out = Linear(stop - start, layer.out_features, bias=False, dtype=layer.weight.dtype)
        out.weight = nn.Parameter(_own(layer.weight.detach()[:, start:stop]), requires_grad=False)
        out.deterministic = layer.deterministic
        return out
    if isinstance(layer, Int8Linear):  # per-output-channel scales: every column keeps its channel's scale
        return Int8Linear(_own(layer.weight_int8[:, start:stop]), _own(layer.scales), None, layer.out_dtype)
    if isinstance(layer, Int4Linear):
        g = layer.group_size
        if start % g or stop % g:
            raise ValueError(f"{name}: int4 groups of {g} input columns do not split at a rank's columns "
                             f"[{start}, {stop}); use a group size dividing {stop - start}")
        q, scales, mins = _int4_form(layer, name)
        return _int4_layer(layer, q[:, start:stop], scales[:, start // g : stop // g],
                           mins[:, start // g : stop // g], stop - start, None)
    raise ValueError(f"{name}: tensor parallelism cannot shard a {type(layer).__name__}")


def layer_bias(layer: nn.Module) -> torch.Tensor | None:
    bias = getattr(layer, "bias", None)
    return None if bias is None else _own(bias.detach())


def _int4_form(layer: Int4Linear, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if layer._kernel_form is None:
        raise ValueError(f"{name}: this int4 layer keeps no codes to slice (not built by quantize_linears)")
    return layer._kernel_form


def _int4_layer(like: Int4Linear, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                in_features: int, bias: torch.Tensor | None) -> Int4Linear:
    q, scales, mins = _own(q), _own(scales), _own(mins)
    packed, scales_and_zeros = _torch_int4_form(q, scales, mins)
    out = Int4Linear(packed, scales_and_zeros, like.group_size, in_features, bias, like.out_dtype)
    out._kernel_form = (q, scales, mins)
    return out
