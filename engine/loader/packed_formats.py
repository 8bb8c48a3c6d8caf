"""GPTQ and AWQ packed linear layers -> integer codes, zero points and scales -> float weights.

Both store ``w[o, i] = (code[o, i] - zero[o, g]) * scale[o, g]`` for the group ``g`` of input
column ``i``, with ``bits``-wide codes packed into int32 words, lowest bits first:

- GPTQ (AutoGPTQ's ``QuantLinear.pack``): ``qweight`` [in / per_word, out] packs consecutive input
  rows of the transposed weight; ``qzeros`` [groups, out / per_word] packs consecutive output
  columns, each zero point stored minus one in the v1 format; ``scales`` [groups, out]; ``g_idx``
  [in] names each input column's group (act-order permutes them).
- AWQ GEMM (AutoAWQ's ``WQLinear_GEMM.from_linear``): ``qweight`` [in, out / 8] and ``qzeros``
  [in / group, out / 8] both pack output columns, eight to a word in the interleaved order
  0, 2, 4, 6, 1, 3, 5, 7; ``scales`` [in / group, out]; groups are consecutive input columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protoserve.engine.loader.quantization_config import AWQ, PackedQuantization
from protoserve.engine.models.linear import INT4_GROUP_SIZES, Int4Grid

# AWQ packs output column AWQ_ORDER[j] into nibble j of a word; nibble AWQ_UNDO[c] holds column c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))


class PackError(ValueError):
    """A packed tensor whose contents are inconsistent: names the tensor."""

    def __init__(self, tensor: str, problem: str) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r} {problem}")


@dataclass
class IntWeight:
    """One linear layer as integers: ``w[o, i] = (codes[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]]``."""

    codes: torch.Tensor  # [out, in] int32
    zeros: torch.Tensor  # [out, groups] int32
    scales: torch.Tensor  # [out, groups], the checkpoint's float dtype
    g_idx: torch.Tensor  # [in] int64
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]; exact, as each value is a small integer times a float16/bfloat16 scale."""
        return (self.codes - self.zeros[:, self.g_idx]).float() * self.scales.float()[:, self.g_idx]

    def int4_grid(self) -> Int4Grid | None:
        """The int4 kernels' form of this layer's grid: 4-bit codes in consecutive groups of a size the
        kernels take, scales float16-exact; None otherwise (act-order, 8 bits, one group per long row)."""
        out, k = self.codes.shape
        groups = self.scales.shape[1]
        if self.bits != 4 or k % groups or k // groups not in INT4_GROUP_SIZES:
            return None
        size = k // groups
        if not torch.equal(self.g_idx, torch.arange(k) // size):
            return None
        scales = self.scales.to(torch.float16)
        if not torch.equal(scales.float(), self.scales.float()):
            return None
        mins = (-self.zeros.float() * self.scales.float()).to(torch.float16)
        return Int4Grid(scales, mins, size)


def unpack(packing: PackedQuantization, tensors: Mapping[str, torch.Tensor], layer: str) -> IntWeight:
    """A layer's packed tensors (by suffix: qweight, qzeros, scales, g_idx), shapes already checked."""
    if not bool(torch.isfinite(tensors["scales"]).all()):
        raise PackError(f"{layer}.scales", "holds values that are not finite")
    if packing.method == AWQ:
        return _unpack_awq(packing, tensors)
    return _unpack_gptq(packing, tensors, layer)


def _unpack_gptq(packing: PackedQuantization, tensors: Mapping[str, torch.Tensor], layer: str) -> IntWeight:
    scales = tensors["scales"]
    groups = scales.shape[0]
    codes = _unpack_rows(tensors["qweight"], packing.bits).t()  # [out, in]
    zeros = _unpack_columns(tensors["qzeros"], packing.bits) + packing.zero_offset
    g_idx = tensors["g_idx"].long()
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise PackError(f"{layer}.g_idx", f"holds group indices outside 0..{groups - 1} ({groups} groups in scales)")
    return IntWeight(codes.contiguous(), zeros.t().contiguous(), scales.t().contiguous(), g_idx, packing.bits)


def _unpack_awq(packing: PackedQuantization, tensors: Mapping[str, torch.Tensor]) -> IntWeight:
    scales = tensors["scales"]
    groups = scales.shape[0]
    undo = torch.tensor(AWQ_UNDO)
    codes = _unpack_columns(tensors["qweight"], packing.bits)
    codes = codes.reshape(codes.shape[0], -1, 8)[:, :, undo].reshape(codes.shape[0], -1)  # [in, out]
    zeros = _unpack_columns(tensors["qzeros"], packing.bits)
    zeros = zeros.reshape(groups, -1, 8)[:, :, undo].reshape(groups, -1)
    k = codes.shape[0]
    g_idx = torch.arange(k) // (k // groups)
    return IntWeight(codes.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous(), g_idx, packing.bits)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] words -> [R * per_word, C] codes: word r holds rows r * per_word + j at bits * j."""
    values = (packed[:, None, :] >> _shifts(bits)[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] words -> [R, C * per_word] codes: word c holds columns c * per_word + j at bits * j."""
    values = (packed[:, :, None] >> _shifts(bits)[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)
