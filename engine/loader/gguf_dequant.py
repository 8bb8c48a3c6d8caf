"""Dequantize GGUF tensor data (raw ggml block bytes) into float32 torch tensors.

Every kernel works on a whole tensor at once: the bytes are viewed as a
``(n_blocks, type_size)`` uint8 matrix and unpacked with vectorised bit
operations, so there is no Python loop over blocks. The arithmetic follows
ggml's reference order (``d * q + m`` in float32, float16 scales widened
first), which makes the results bit-identical to ``gguf.quants.dequantize``.

The kernels use numpy rather than torch: unpacking is many small uint8 ops,
which numpy runs single-threaded at memory speed, while torch's OpenMP pool
pays a synchronisation cost per op that dominates on small or busy CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from protoserve.engine.loader.errors import ModelLoadError

QK_K = 256  # elements per K-quant super-block

_Kernel = Callable[[np.ndarray], np.ndarray]

_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFTS_1BIT = np.arange(8, dtype=np.uint8)


def _f16(field: np.ndarray) -> np.ndarray:
    """A ``(n, 2)`` byte slice holding one little-endian float16 per block, as ``(n, 1)`` float32."""
    return field.view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Split ``(..., k)`` bytes into ``(..., 2k)`` 4-bit values: all low nibbles, then all high nibbles.

    This is ggml's layout for 32-element groups: byte j holds elements j and j + k.
    """
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    """``(n, k)`` bytes as ``(n, 8k)`` single bits, little-endian (bit i of the word is element i)."""
    return ((packed[..., None] >> _SHIFTS_1BIT) & 1).reshape(packed.shape[0], -1)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float32).copy()  # copy: never hand out a view of the read-only memory map


def _f16_plain(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32, so widening is a 16-bit shift.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    q *= d
    return q


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    q = (_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)
    q *= d
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    q *= d
    q += m
    return q


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    high = _bits(blocks[:, 2:6])
    q = ((_nibbles(blocks[:, 6:]) | (high << 4)).astype(np.int8) - np.int8(16)).astype(np.float32)
    q *= d
    return q


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    high = _bits(blocks[:, 4:8])
    q = (_nibbles(blocks[:, 8:]) | (high << 4)).astype(np.float32)
    q *= d
    q += m
    return q


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 bytes of 6-bit (scale, min) pairs of Q4_K/Q5_K into two ``(n, 8)`` arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7;
    bytes 4-7 the same for mins; bytes 8-11 the low nibbles of scales and
    mins 4-7.
    """
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _two_bit_groups(packed: np.ndarray) -> np.ndarray:
    """``(n, 64)`` bytes of 2-bit values as ``(n, 16, 16)``.

    Two 32-byte halves of 128 elements; within a half, bit pair k of byte j
    is element 32k + j.
    """
    n = packed.shape[0]
    return ((packed.reshape(n, 2, 1, 32) >> _SHIFTS_2BIT[:, None]) & 3).reshape(n, 16, 16)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _two_bit_groups(blocks[:, 16:80]).astype(np.float32)
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    hmask, scales = blocks[:, :32], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    # 16 signed 6-bit scales: low nibbles from bytes 0-7, top two bits from bytes 8-11.
    low = _nibbles(scales[:, :8])
    high = ((scales[:, 8:12].reshape(n, 1, 4) >> _SHIFTS_2BIT[:, None]) & 3).reshape(n, 16)
    sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
    dl = (d * sc.astype(np.float32)).reshape(n, 16, 1)
    ql = _two_bit_groups(blocks[:, 32:96])
    qh = ((hmask.reshape(n, 1, 32) >> _SHIFTS_1BIT[:, None]) & 1).reshape(n, 16, 16)
    # ggml stores the high bit inverted: a clear bit means "subtract 4".
    q = (ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)).astype(np.float32)
    q *= dl
    return q.reshape(n, QK_K)


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """``(n, 128)`` bytes as ``(n, 8, 32)`` 4-bit values.

    Four 32-byte chunks; chunk c's low nibbles are sub-block 2c, its high nibbles sub-block 2c + 1.
    """
    n = packed.shape[0]
    chunks = packed.reshape(n, 4, 1, 32)
    return np.concatenate((chunks & 0x0F, chunks >> 4), axis=2).reshape(n, 8, 32)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    q = _k_nibbles(blocks[:, 16:]).astype(np.float32)
    q *= scale
    q -= offset
    return q.reshape(n, QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    # Bit i of qh[j] is the fifth bit of element j of sub-block i.
    qh = (blocks[:, 16:48].reshape(n, 1, 32) >> _SHIFTS_1BIT[:, None]) & 1
    q = (_k_nibbles(blocks[:, 48:]) | (qh << 4)).astype(np.float32)
    q *= scale
    q -= offset
    return q.reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, 16, 1)
    # Two 128-element halves. Low nibbles: 64 bytes per half, all low nibbles
    # then all high. High bit pairs: 32 bytes per half, pair k of byte j is
    # element 32k + j.
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFTS_2BIT[:, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    q *= scale
    return q.reshape(n, QK_K)


# Plain float types take the flat byte array; block types take (n_blocks, type_size).
_KERNELS: dict[GGMLQuantizationType, _Kernel] = {
    GGMLQuantizationType.F32: _f32,
    GGMLQuantizationType.F16: _f16_plain,
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_KERNELS)


def type_name(qtype: GGMLQuantizationType | int) -> str:
    """The ggml name of a tensor type id, also for ids this gguf version does not know."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type id {int(qtype)}"


def dequantize(
    data: np.ndarray,
    qtype: GGMLQuantizationType | int,
    shape: Sequence[int],
    *,
    tensor_name: str = "<tensor>",
    source: str | os.PathLike[str] = "<memory>",
) -> torch.Tensor:
    """Dequantize the raw bytes of one ggml tensor into a float32 tensor of ``shape``.

    ``shape`` is in torch order (slowest dimension first, i.e. GGUF's ``ne``
    reversed); its last dimension must be a whole number of blocks. ``data``
    is any array whose bytes are the tensor's ggml encoding (the
    ``ReaderTensor.data`` of ``gguf.GGUFReader`` works as is). Raises
    ModelLoadError naming ``source`` and ``tensor_name`` for an unsupported
    type or a byte count that does not match the shape.
    """
    kernel = _KERNELS.get(qtype)  # type: ignore[call-overload]
    if kernel is None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelLoadError(
            source, f"tensor {tensor_name!r} has unsupported type {type_name(qtype)} (supported: {supported})"
        )
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] % block_size:
        raise ModelLoadError(
            source,
            f"tensor {tensor_name!r}: row length of shape {shape} is not a multiple of "
            f"the {qtype.name} block size {block_size}",
        )
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block_size
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size != n_blocks * type_size:
        raise ModelLoadError(
            source,
            f"tensor {tensor_name!r} ({qtype.name}, shape {shape}) needs "
            f"{n_blocks * type_size} bytes but has {raw.size}",
        )
    values = kernel(raw if block_size == 1 else raw.reshape(n_blocks, type_size))
    return torch.from_numpy(values.reshape(shape))
