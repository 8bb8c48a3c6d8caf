"""Pack linear weights for ``kernels/cpu/linear.cpp`` and call it.

A ``PackedWeight`` is one linear layer's weight in the kernel's layout: output
channels in blocks of ``BLOCK_N`` = 4 and, inside a block, K in chunks of 16
values with the block's four channels side by side (int4: 32 values per 16-byte
chunk, low nibbles first). Formats:

* ``float32`` / ``bfloat16``: the weight as it is, reordered;
* ``int8``: symmetric per-output-channel codes, ``w = q * scale``;
* ``int4``: asymmetric groups along K, ``w = q * scale + min`` with q in 0..15.

``reference_linear`` computes the same product in plain PyTorch from the
unpacked weight, for tests and for machines without the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.extension import load

BLOCK_N = 4
CHUNK = 16
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}


@dataclass
class PackedWeight:
    """One layer's weight in the kernel layout (see the module docstring)."""

    format: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor | None = None  # int8: [N]; int4: [blocks, groups, 4]
    mins: torch.Tensor | None = None  # int4: [blocks, groups, 4]
    group_size: int = 0  # int4 only

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)


def available() -> bool:
    return load("linear") is not None


def supports(in_features: int) -> bool:
    """The kernel works on 16-value chunks of K."""
    return in_features % CHUNK == 0


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0]
    padded = -(-n // BLOCK_N) * BLOCK_N
    if padded == n:
        return t
    return torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])])


def _interleave(w: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N, K] -> [N/4, K/chunk, 4, chunk] contiguous (rows already padded to a multiple of 4)."""
    n, k = w.shape
    if not supports(k):
        raise ValueError(f"the kernel needs in_features to be a multiple of {CHUNK}, got {k}")
    return w.reshape(n // BLOCK_N, BLOCK_N, k // chunk, chunk).transpose(1, 2).contiguous()


def pack_dense(weight: torch.Tensor) -> PackedWeight:
    """float32 or bfloat16 weight [N, K], kept in its dtype."""
    fmt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(weight.dtype)
    if fmt is None:
        raise ValueError(f"dense packing takes float32 or bfloat16 weights, not {weight.dtype}")
    n, k = weight.shape
    return PackedWeight(fmt, n, k, _interleave(_pad_rows(weight.detach()), CHUNK))


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """int8 codes [N, K] and per-channel scales [N]: ``w = q * scale``."""
    n, k = q.shape
    return PackedWeight(
        "int8", n, k, _interleave(_pad_rows(q.to(torch.int8)), CHUNK), scales=scales.float().contiguous()
    )


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> PackedWeight:
    """Codes q [N, K] in 0..15 with scales/mins [N, K/group_size]: ``w = q * scale + min``."""
    n, k = q.shape
    if k % 32 or group_size % 32 or k % group_size:
        raise ValueError(f"int4 packing needs K ({k}) and the group ({group_size}) to be multiples of 32")
    codes = _pad_rows(q.to(torch.uint8))
    blocks = codes.shape[0] // BLOCK_N
    pairs = codes.reshape(codes.shape[0], k // 32, 2, 16)
    packed = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)  # [N, K/32, 16]
    data = packed.reshape(blocks, BLOCK_N, k // 32, 16).transpose(1, 2).contiguous()

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [blocks, groups, 4]
        return _pad_rows(t.float()).reshape(blocks, BLOCK_N, -1).transpose(1, 2).contiguous()

    return PackedWeight("int4", n, k, data, per_block(scales), per_block(mins), group_size)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] (any float dtype), float32 result [M, N]."""
    ext = load("linear")
    if ext is None:
        raise RuntimeError("the CPU linear kernel is not available on this machine")
    return ext.packed_linear(
        x.float().contiguous(),
        FORMATS[weight.format],
        weight.data,
        weight.scales,
        weight.mins,
        None if bias is None else bias.float().contiguous(),
        weight.out_features,
        weight.group_size,
    )


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the packed form stands for (tests, reference)."""
    n, k = weight.out_features, weight.in_features
    if weight.format in ("float32", "bfloat16", "int8"):
        w = weight.data.transpose(1, 2).reshape(-1, k)[:n].float()
        return w * weight.scales[:n, None] if weight.format == "int8" else w
    blocks = weight.data.shape[0]
    packed = weight.data.transpose(1, 2).reshape(blocks * BLOCK_N, k // 32, 16)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(-1, k)[:n].float()

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(blocks * BLOCK_N, -1)[:n].repeat_interleave(weight.group_size, dim=1)

    return codes * per_row(weight.scales) + per_row(weight.mins)


def reference_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64 PyTorch, rounded to float32."""
    y = x.double() @ unpack(weight).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()
