"""FP8 (E4M3) weight-only matmul, ``y = x @ W.T (+ b)``, with one float32 scale per output channel.

Storage (:class:`Fp8Weight`): codes [N, K] ``torch.float8_e4m3fn`` (one byte a weight, row-major,
the layout of the float weight) and scales [N] float32, ``w = code * scale``. ``quantize_fp8``
takes ``scale = amax / 448`` per row (448: E4M3's largest finite value; an all-zero row gets
scale 1) and ``code = float8_e4m3fn(clamp(w / scale, -448, 448))``, ``w / scale`` in float32 and
torch's round-to-nearest-even cast; the clamp keeps the cast off NaN (E4M3 has no infinity) where
``w / scale`` rounds a hair past 448. Every code is finite, which the kernel relies on: the
interpreter decodes the NaN patterns 0x7F / 0xFF as +-480 where the GPU gives NaN.

The kernel loads the codes as ``tl.float8e4nv`` and converts them with Triton's own cast: on the
GPU that is the native E4M3 conversion (sm_89 or newer, ``fp8_matmul`` refuses older devices),
and Triton's interpreter (3.9.0) loads ``float8_e4m3fn`` tensors and decodes all 254 finite codes,
subnormals included, exactly as torch does, so no bit-pattern arithmetic is needed on either.
Only the weights are 8-bit: activations are not quantized. An E4M3 code is exact in bfloat16 and
float16, so on the GPU a bfloat16 / float16 ``x`` meets the codes cast to its own dtype in a
native ``tl.dot`` (exact products, float32 accumulation); float32 ``x`` (and every dtype under the
interpreter, whose bfloat16 dot is broken, see ``_common``) uses an IEEE float32 dot with no TF32.
The per-channel scale multiplies the finished sum, then the bias is added: the result is
``reference_fp8_matmul`` up to float32 summation order and that one final rounding.

One program per (``BLOCK_M`` rows, ``BLOCK_N`` channels) tile walks all of K in ``BLOCK_K``
steps; the tiles never depend on M and K is never split, so each output row is summed in the same
order whatever the batch: a row's result is bit-identical alone or inside any batch. The
interpreter's ``tl.dot`` is numpy's matmul, whose BLAS rounds a row differently by its position in
the tile, so there each program takes one row (the GPU's MMA treats every row of a tile alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from protoserve.kernels.triton._common import check_dim, check_tensor, check_unit_stride, interpreted

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first with E4M3 conversions (Triton's fp8e4nv)
BLOCK_M = 16  # tl.dot's smallest row tile on the GPU; 1 under the interpreter (module docstring)
# GPU tiles, fixed for every M (batch invariance): the fastest of a sweep on an H200 at
# M = 1 / 16 / 128 over [4096, 4096], [14336, 4096] and [4096, 14336] bfloat16 products
GPU_TILES = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
INTERPRETER_TILES = {"BLOCK_N": 32, "BLOCK_K": 32}


@dataclass(frozen=True)
class Fp8Weight:
    """An [N, K] weight as E4M3 codes [N, K] and per-output-channel float32 scales [N]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds: one per code plus four per channel scale."""
        return (
            self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
        )

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.codes.to(device), self.scales.to(device))


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """[N, K] float32 / bfloat16 / float16 weight -> E4M3 codes with per-row scales ``amax / 448``."""
    check_tensor("weight", weight, ndim=2, dtypes=WEIGHT_DTYPES)
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight must have at least one row and one column, got shape {tuple(weight.shape)}")
    w = weight.float()
    if not torch.isfinite(w).all():
        raise ValueError("weight has non-finite values (inf or NaN): E4M3 codes cannot hold them")
    scales = w.abs().amax(dim=1) / FP8_MAX
    # zero rows, and rows so small that amax / 448 underflows: scale 1 (their codes round to 0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes.contiguous(), scales.contiguous())


def dequantize_fp8(weight: Fp8Weight) -> torch.Tensor:
    """``code * scale`` [N, K] in float64, where it is exact (a 4-bit by 24-bit significand product);
    ``.float()`` rounds it once more to float32."""
    return weight.codes.double() * weight.scales.double()[:, None]


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, codes_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_cn, stride_om,
    HAS_BIAS: tl.constexpr, LOW_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    code_base = cols.to(tl.int64) * stride_cn  # int64: weights past 2**31 bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        code = tl.load(
            codes_ptr + code_base[None, :] + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        if LOW_DOT:  # bfloat16 / float16 x: the codes are exact in its dtype
            acc += tl.dot(x, code.to(x.dtype))
        else:
            acc += tl.dot(x.to(tl.float32), code.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def check_fp8_weight(weight: Fp8Weight, device: torch.device) -> None:
    """Codes [N, K] float8_e4m3fn, contiguous; scales [N] float32; both on ``device``."""
    if not isinstance(weight, Fp8Weight):
        raise ValueError(f"weight must be an Fp8Weight, got {type(weight).__name__}")
    check_tensor("weight.codes", weight.codes, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    if not weight.codes.is_contiguous():
        raise ValueError(f"weight.codes must be contiguous, got strides {weight.codes.stride()}")
    check_tensor("weight.scales", weight.scales, ndim=1, dtypes=(torch.float32,), device=device)
    check_dim("weight.scales", weight.scales.shape[0], weight.out_features, "length (out_features)")
    check_unit_stride("weight.scales", weight.scales)


def check_fp8_device(device: torch.device) -> None:
    """E4M3 conversions exist on CUDA devices of compute capability 8.9 and newer."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"x is on {device}, compute capability {capability[0]}.{capability[1]}: FP8 (E4M3) weights need 8.9 or newer"
        )


def fp8_matmul(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] (float32, bfloat16 or float16) -> float32 [M, N].

    ``weight``: an :class:`Fp8Weight` on x's device; ``bias``: [N] (float32, bfloat16 or float16) or None.
    """
    check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES)
    check_fp8_weight(weight, x.device)
    check_dim("x", x.shape[1], weight.in_features, "in_features (dim 1)")
    check_unit_stride("x", x)
    n = weight.out_features
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=ACTIVATION_DTYPES, device=x.device)
        check_dim("bias", bias.shape[0], n, "length (out_features)")
        check_unit_stride("bias", bias)
    check_fp8_device(x.device)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    interp = interpreted(_fp8_matmul_kernel)
    block_m, tiles = (1, INTERPRETER_TILES) if interp else (BLOCK_M, GPU_TILES)
    _fp8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, tiles["BLOCK_N"]))](
        x, weight.codes, weight.scales, bias if bias is not None else out, out,
        m, n, weight.in_features,
        x.stride(0), weight.codes.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, LOW_DOT=x.dtype != torch.float32 and not interp,
        BLOCK_M=block_m, **tiles,
    )  # fmt: skip
    return out


def reference_fp8_matmul(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in float64 PyTorch from the exact dequantized weight (``dequantize_fp8``) -> float32."""
    y = x.double() @ dequantize_fp8(weight).T
    if bias is not None:
        y = y + bias.double()
    return y.float()
