"""What the Triton kernels share: argument checks that name the bad argument, and bfloat16 rounding.

``round_to_bf16`` rounds float32 values to the nearest bfloat16 (ties to even) and keeps them in
float32. The kernels use it wherever a value is rounded to bfloat16 (the scaled query and the
softmax probabilities of a bfloat16 KV pool) instead of ``.to(tl.bfloat16)``: Triton's interpreter
truncates on that cast where the GPU rounds to nearest, so the explicit integer rounding gives
one result on both. Under the interpreter the launchers also keep bfloat16 operands out of
``tl.dot`` (``interpreted``), whose bfloat16 dot returns garbage in triton 3.9.0: there the
rounded float32 values go through a float32 dot, which computes the same exact products (only the
summation order differs from a GPU's bfloat16 dot with float32 accumulation).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

INDEX_DTYPE = torch.int32


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``t`` as a tensor of the given rank, dtype and device, else a ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must be {names}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other operands on {device}")
    return t


def check_dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: {what} is {actual}, expected {expected}")


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The kernels read the last dimension as contiguous lanes."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, n)))


# K/V elements one key tile may hold on a GPU: 64 keys up to heads of 256 (every GQA family), fewer
# for MLA's latent heads (DeepSeek: 576, padded to 1024), whose 64-key float32 tiles would not fit
# in shared memory.
KEY_TILE_ELEMENTS = 64 * 256


def key_tile(block_d: int, cpu: bool) -> int:
    """BLOCK_N, the keys of one tile: 16 under the interpreter (small tiles run faster there)."""
    return 16 if cpu else max(16, min(64, KEY_TILE_ELEMENTS // block_d))


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in the interpreter. Triton decides when a ``@triton.jit`` function
    is defined (from ``TRITON_INTERPRET`` then), so the kernel object, not the environment now, says.
    Interpreted kernels get small tiles and no bfloat16 ``tl.dot`` (see the module docstring)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


@triton.jit
def round_to_bf16(x):
    """float32 -> the nearest bfloat16 (ties to even), as float32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_kv_tile(k_ptr, v_ptr, table_row_ptr, keys, key_ok, d, d_ok, kv_head, block_size,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh):  # fmt: skip
    """K and V [BLOCK_N, BLOCK_D] float32 of ``keys`` through one sequence's block table (masked keys: 0)."""
    block = tl.load(table_row_ptr + keys // block_size, mask=key_ok, other=0).to(tl.int64)  # pools past 2**31 elements
    offset = keys % block_size
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
        mask=kv_mask, other=0.0,
    ).to(tl.float32)
    v = tl.load(
        v_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
        mask=kv_mask, other=0.0,
    ).to(tl.float32)
    return k, v


@triton.jit
def tanh(x):
    """tanh in float32 from exp (the interpreter runs no libdevice call): a short odd series where
    ``1 - exp(-2|x|)`` would cancel (|x| < 1/8: the next term is below 1e-12), the exp form elsewhere."""
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)
    far = (1.0 - t) / (1.0 + t)
    a2 = a * a
    near = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    y = tl.where(a < 0.125, near, far)
    return tl.where(x < 0, -y, y)


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, softcap, BF16: tl.constexpr, BF16_DOT: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    """One key tile of flash attention: scores of the visible keys, the running max, sum and output
    rescaled; returns the new (m_i, l_i, acc). Under BF16 P is rounded to bfloat16 as the pool is.
    Under SOFTCAP the scores are ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); without
    it that step is not compiled in, so an uncapped model's bits do not move."""
    if BF16_DOT:
        s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BF16:
        p = round_to_bf16(p)
    if BF16_DOT:
        pv = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc * alpha[:, None] + pv
