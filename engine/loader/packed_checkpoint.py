"""Reading a GPTQ/AWQ checkpoint: packed layers -> float weights, plus each layer's int4 grid.

A layer is packed where the directory holds ``<layer>.qweight`` in place of ``<layer>.weight``
(a format's unconverted modules, e.g. AWQ's ``modules_to_not_convert``, stay float). Each packed
layer's tensors are checked by name, shape and dtype before any is read, then unpacked
(engine/loader/packed_formats.py) and dequantized to the float weight the decoder expects, so
every family loads these checkpoints unchanged. Where the grid fits the int4 kernels (4-bit codes
in consecutive groups of 32-256 columns), ``module_grids`` hands it to ``quantize_linears``, which
then serves the checkpoint's own codes instead of rounding the float weights again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import HFCheckpoint, load_hf_tensors
from protoserve.engine.loader.packed_formats import PackError, unpack
from protoserve.engine.loader.quantization_config import AWQ, KEY, PackedQuantization
from protoserve.engine.models.linear import Int4Grid, Linear

SUFFIXES = {AWQ: ("qweight", "qzeros", "scales")}
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
INT32_SUFFIXES = ("qweight", "qzeros", "g_idx")
# The decoder's fused layers and the checkpoint layers whose rows they stack, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class PackedWeights:
    """A packed checkpoint read: float weights by Hugging Face name, and the packed layers' int4 grids
    (None where a layer's grid does not fit the int4 kernels)."""

    weights: dict[str, torch.Tensor]
    grids: dict[str, Int4Grid | None]

    def stored_mode(self) -> str:
        """``--quantization auto``'s mode: int4 where every packed layer's grid fits, else int8 (never
        fewer bits than the file has)."""
        return "int4" if self.group_size() is not None else "int8"

    def group_size(self) -> int | None:
        """The one group size of the packed layers' int4 grids; None when any does not fit."""
        sizes = {g.group_size if g is not None else None for g in self.grids.values()}
        return sizes.pop() if len(sizes) == 1 else None


def load_packed_tensors(
    ckpt: HFCheckpoint, expected: Mapping[str, tuple[int, ...]], progress: bool = True
) -> PackedWeights:
    """Read ``ckpt`` (which has a quantization config) into the float tensors ``expected`` names."""
    packing = ckpt.quantization
    assert packing is not None
    layers = [
        name.removesuffix(".weight")
        for name, shape in expected.items()
        if name.endswith(".weight") and len(shape) == 2 and name not in ckpt.weight_files
        and name.removesuffix(".weight") + ".qweight" in ckpt.weight_files
    ]
    if not layers:
        raise ModelLoadError(ckpt.index_path, f"{KEY} names {packing.method} but no layer is packed "
                                              "(no <layer>.qweight tensor among the expected layers)")
    raw_expected = dict(expected)
    int32_names: set[str] = set()
    for layer in layers:
        out, k = raw_expected.pop(layer + ".weight")
        for suffix, shape in packed_shapes(packing, layer, out, k, ckpt).items():
            raw_expected[f"{layer}.{suffix}"] = shape
            if suffix in INT32_SUFFIXES:
                int32_names.add(f"{layer}.{suffix}")
    weights = load_hf_tensors(ckpt, raw_expected, progress, int32_names)
    grids: dict[str, Int4Grid | None] = {}
    for layer in layers:
        parts = {s: weights.pop(f"{layer}.{s}") for s in _suffixes(packing)}
        try:
            integer = unpack(packing, parts, layer)
        except PackError as e:
            raise ModelLoadError(ckpt.weight_files[e.tensor], str(e)) from e
        weights[layer + ".weight"] = integer.dequantize()
        grids[layer] = integer.int4_grid()
    return PackedWeights(weights, grids)


def packed_shapes(
    packing: PackedQuantization, layer: str, out: int, k: int, ckpt: HFCheckpoint
) -> dict[str, tuple[int, ...]]:
    """The packed tensors of a [out, k] layer, by suffix, with their shapes."""
    per = packing.per_word
    size = packing.group_size or k

    def refuse(suffix: str, problem: str) -> ModelLoadError:
        name = f"{layer}.{suffix}"
        return ModelLoadError(ckpt.weight_files.get(name, ckpt.index_path), f"tensor {name!r}: {problem}")

    if out % per:
        raise refuse("qzeros", f"out_features {out} is not a multiple of {per} codes per int32")
    if packing.method == AWQ:
        if k % size:
            raise refuse("scales", f"AWQ group size {size} does not divide in_features {k}")
        return {"qweight": (k, out // per), "qzeros": (k // size, out // per), "scales": (k // size, out)}
    if k % per:
        raise refuse("qweight", f"in_features {k} is not a multiple of {per} codes per int32")
    groups = -(-k // size)
    return {"qweight": (k // per, out), "qzeros": (groups, out // per), "scales": (groups, out), "g_idx": (k,)}


def _suffixes(packing: PackedQuantization) -> tuple[str, ...]:
    return SUFFIXES.get(packing.method, GPTQ_SUFFIXES)


def module_grids(model: nn.Module, grids: Mapping[str, Int4Grid | None]) -> dict[str, Int4Grid]:
    """The int4 grids of ``model``'s float ``Linear`` layers by module name, the decoder's fused layers'
    stacked from their parts. A grid is kept only where it holds the layer's weights (each within a
    sixteenth of a step), so a layer the names do not map serves int4 rounded afresh, never wrong codes."""
    out: dict[str, Int4Grid] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight is None:
            continue
        parts = _grid_parts(name, grids)
        if parts is None:
            continue
        grid = Int4Grid(torch.cat([g.scales for g in parts]), torch.cat([g.mins for g in parts]), parts[0].group_size)
        if _holds(grid, module.weight.detach()):
            out[name] = grid
    return out


def _grid_parts(module_name: str, grids: Mapping[str, Int4Grid | None]) -> list[Int4Grid] | None:
    parent, _, leaf = module_name.rpartition(".")
    prefix = f"model.{parent}." if parent else ""
    for leaves in ((leaf,), FUSED.get(leaf, ())):
        parts = [grids.get(prefix + part) for part in leaves]
        if leaves and all(p is not None for p in parts) and len({p.group_size for p in parts}) == 1:
            return parts  # type: ignore[return-value]
    return None


def _holds(grid: Int4Grid, weight: torch.Tensor) -> bool:
    n, k = weight.shape
    if tuple(grid.scales.shape) != (n, k // grid.group_size) or k % grid.group_size:
        return False
    w = weight.float().reshape(n, -1, grid.group_size)
    scales, mins = grid.scales.float()[..., None], grid.mins.float()[..., None]
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round((w - mins) / step).clamp(0, 15)
    return bool(((codes * scales + mins - w).abs() <= scales / 16).all())
