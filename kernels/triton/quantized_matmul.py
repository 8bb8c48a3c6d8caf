"""Weight-only int8 / int4 matmul, ``y = x @ W.T (+ b)``, dequantizing the CPU path's packs in the kernel.

The weights are ``kernels/cpu/packed_linear.PackedWeight``s exactly as the CPU kernels store them,
so a quantized model packs once for either device (moved with ``.to(device)`` per tensor):

* ``int8``: codes [N/4, K/16, 4, 16] int8, per-channel scales [N] float32, ``w = q * scale``;
* ``int4``: codes [N/4, K/32, 4, 16] uint8 (k % 32 < 16 in the low nibble of byte k % 16, the
  rest in the high one), scales and mins [N/4, K/group, 4] float32, ``w = q * scale + min``;
* ``int8_dot``: unsigned codes ``q + 128`` [N/16, K/32, 8, 16, 4] (chunk j: k = 4j..4j+3), scales
  and mins [N/16, 1, 16] float16 with ``min = -128 * scale``, ``w = u * scale + min``;
* ``int4_dot``: codes [N/16, K/32, 4, 16, 4] uint8 (chunk j: k = 8j..8j+3 low nibbles, 8j+4..8j+7
  high), scales and mins [N/16, K/group, 16] float16, ``w = q * scale + min``.

Output channels are padded to the pack's channel block (4 or 16) with zero codes; the kernel
masks them off. Unlike the CPU integer-dot kernels, this one does not quantize the activations.
Float32 activations multiply the dequantized float32 weights (IEEE float32 dot, no TF32), so all
four formats give ``reference_quantized_matmul`` up to float32 summation order. On a GPU, bfloat16
or float16 activations take the tensor cores instead: each 32-value step multiplies x by the raw
codes (exact in 16 bits) with float32 accumulation and adds ``(x . q) * scale + sum(x) * min``, the
same products factored (the interpreter's 16-bit dot is not trusted, so it widens them to float32).

One program per (``BLOCK_M`` rows, ``BLOCK_N`` channels) tile walks K in steps of 32: a step never
straddles an int4 group (group sizes are multiples of 32), so it loads one scale and min per
channel, dequantizes its [32, BLOCK_N] weight tile in registers and accumulates ``x @ w``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from protoserve.kernels.cpu.packed_linear import PackedWeight, unpack
from protoserve.kernels.triton._common import check_dim, check_tensor, check_unit_stride, interpreted

# Format codes of the kernel's FMT constexpr.
FORMATS = {"int8": 0, "int4": 1, "int8_dot": 2, "int4_dot": 3}
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16
BLOCK_K = 32  # divides every int4 group size, and the *_dot formats' 32-value blocks


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, data_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, num_groups,
    stride_xm, stride_om,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, LOW_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    if FMT == 0:
        lanes = 4
        chunks = K // 16
    elif FMT == 1:
        lanes = 4
        chunks = K // 32
    else:
        lanes = 16
        chunks = K // 32
    vec = (cols // lanes).to(tl.int64)  # the channel block a column lives in; int64: packs past 2**31 bytes
    lane = cols % lanes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        kk = ks % 32
        if FMT == 0:
            off = ((vec[None, :] * chunks + (ks // 16)[:, None]) * 4 + lane[None, :]) * 16 + (ks % 16)[:, None]
            code = tl.load(data_ptr + off, mask=w_mask, other=0).to(tl.float32)
        elif FMT == 1:
            off = ((vec[None, :] * chunks + (ks // 32)[:, None]) * 4 + lane[None, :]) * 16 + (kk % 16)[:, None]
            byte = tl.load(data_ptr + off, mask=w_mask, other=0).to(tl.int32)
            code = ((byte >> ((kk // 16) * 4)[:, None]) & 0xF).to(tl.float32)
        elif FMT == 2:
            off = ((vec[None, :] * chunks + (ks // 32)[:, None]) * 8 + (kk // 4)[:, None]) * 64
            off += lane[None, :] * 4 + (kk % 4)[:, None]
            code = tl.load(data_ptr + off, mask=w_mask, other=0).to(tl.float32)
        else:
            off = ((vec[None, :] * chunks + (ks // 32)[:, None]) * 4 + (kk // 8)[:, None]) * 64
            off += lane[None, :] * 4 + (kk % 4)[:, None]
            byte = tl.load(data_ptr + off, mask=w_mask, other=0).to(tl.int32)
            code = ((byte >> (((kk % 8) // 4) * 4)[:, None]) & 0xF).to(tl.float32)
        if FMT == 0:  # per channel: the scale multiplies the finished sum
            if LOW_DOT:
                acc += tl.dot(x, code.to(x.dtype))
            else:
                acc += tl.dot(x.to(tl.float32), code, input_precision="ieee")
        else:
            g = k0 // group_size
            meta = (vec * num_groups + g) * lanes + lane
            s = tl.load(scale_ptr + meta, mask=col_ok, other=0.0).to(tl.float32)
            mn = tl.load(min_ptr + meta, mask=col_ok, other=0.0).to(tl.float32)
            if LOW_DOT:  # x . (q s + m) = (x . q) s + (sum x) m over the step's one group; codes exact in bf16
                part = tl.dot(x, code.to(x.dtype))
                acc += part * s[None, :] + tl.sum(x.to(tl.float32), 1)[:, None] * mn[None, :]
            else:
                w = code * s[None, :] + mn[None, :]
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    if FMT == 0:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_pack(weight: PackedWeight, device: torch.device) -> None:
    """The pack is one of the four quantized formats, its tensors shaped as that format stores them."""
    if not isinstance(weight, PackedWeight):
        raise ValueError(f"weight must be a packed_linear.PackedWeight, got {type(weight).__name__}")
    if weight.format not in FORMATS:
        raise ValueError(f"weight.format must be one of {tuple(FORMATS)}, got {weight.format!r}")
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    fmt = weight.format
    if fmt == "int8":
        expected = (_padded(n, 4) // 4, k // 16, 4, 16)
        dtype, meta_dtype = torch.int8, torch.float32
    elif fmt == "int4":
        expected = (_padded(n, 4) // 4, k // 32, 4, 16)
        dtype, meta_dtype = torch.uint8, torch.float32
    else:
        expected = (_padded(n, 16) // 16, k // 32, 8 if fmt == "int8_dot" else 4, 16, 4)
        dtype, meta_dtype = torch.uint8, torch.float16
    check_tensor("weight.data", weight.data, dtypes=(dtype,), device=device)
    if tuple(weight.data.shape) != expected or not weight.data.is_contiguous():
        raise ValueError(f"weight.data of a {fmt} pack [{n}, {k}] must be contiguous {expected}, got {tuple(weight.data.shape)}")
    if fmt == "int8":
        check_tensor("weight.scales", weight.scales, ndim=1, dtypes=(meta_dtype,), device=device)
        check_dim("weight.scales", weight.scales.shape[0], n, "length (out_features)")
        check_unit_stride("weight.scales", weight.scales)
        return
    if g <= 0 or g % BLOCK_K or k % g:
        raise ValueError(f"weight.group_size must be a positive multiple of {BLOCK_K} dividing {k}, got {g}")
    lanes = 4 if fmt == "int4" else 16
    meta_shape = (_padded(n, lanes) // lanes, k // g, lanes)
    for name, t in (("weight.scales", weight.scales), ("weight.mins", weight.mins)):
        check_tensor(name, t, ndim=3, dtypes=(meta_dtype,), device=device)
        if tuple(t.shape) != meta_shape or not t.is_contiguous():
            raise ValueError(f"{name} of a {fmt} pack must be contiguous {meta_shape}, got {tuple(t.shape)}")


def quantized_matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] (float32, bfloat16 or float16) -> float32 [M, N].

    ``weight``: an int8, int4, int8_dot or int4_dot ``PackedWeight`` with its tensors on x's
    device; ``bias``: [N] or None.
    """
    check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES)
    check_pack(weight, x.device)
    check_dim("x", x.shape[1], weight.in_features, "in_features (dim 1)")
    check_unit_stride("x", x)
    n = weight.out_features
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_dim("bias", bias.shape[0], n, "length (out_features)")
        check_unit_stride("bias", bias)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    interp = interpreted(_quantized_matmul_kernel)
    block_n = 32 if interp else 64
    scales = weight.scales
    mins = weight.mins if weight.mins is not None else scales  # int8: no mins, never read
    num_groups = 1 if weight.format == "int8" else weight.in_features // weight.group_size
    _quantized_matmul_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))](
        x, weight.data, scales, mins, bias if bias is not None else out, out,
        m, n, weight.in_features, max(weight.group_size, 1), num_groups,
        x.stride(0), out.stride(0),
        FMT=FORMATS[weight.format], HAS_BIAS=bias is not None, LOW_DOT=x.dtype != torch.float32 and not interp,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def reference_quantized_matmul(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in float64 PyTorch from the pack's own values (``packed_linear.unpack``) -> float32."""
    w = unpack(weight).double()
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.float()
