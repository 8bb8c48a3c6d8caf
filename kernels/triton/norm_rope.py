"""RMSNorm, residual-add + RMSNorm, and rotate-half RoPE in place, as Triton kernels.

The same three operations as ``kernels/cpu/norm_rope.py`` and the engine's ``RMSNorm`` /
``apply_rope`` (engine/models/decoder.py), for float32, bfloat16 and float16 activations: each
computes in float32 and rounds once to the activation dtype on the store (bfloat16 to nearest,
ties to even).

* ``rms_norm(x, w, eps)``: ``w * x / sqrt(mean(x^2) + eps)`` over the last dim, one program per row;
* ``add_rms_norm_(x, residual, w, eps)``: ``residual += x`` in place (rounded to the residual's
  dtype), then RMSNorm of that stored residual;
* ``rope_(x, cos, sin)``: x [T, heads, D] rotated in place by cos/sin [T, D] (both halves
  repeated, the HF layout), ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``;
  one program per token, all heads at once. x may be a strided view (rows of a fused qkv output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from protoserve.kernels.triton._common import (
    check_dim,
    check_tensor,
    check_unit_stride,
    next_pow2,
    round_to_bf16,
)

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    dim, eps,
    stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, RES_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    h = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * stride_r + d, mask=ok, other=0.0).to(tl.float32)
        if RES_BF16:
            h = round_to_bf16(h)
        tl.store(res_ptr + row * stride_r + d, h.to(res_ptr.dtype.element_ty), mask=ok)
        h = h.to(res_ptr.dtype.element_ty).to(tl.float32)  # normalize the residual as stored
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / dim + eps)
    y = h * rstd * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if OUT_BF16:
        y = round_to_bf16(y)
    tl.store(out_ptr + row * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr,
    num_heads, half,
    stride_xt, stride_xh, stride_ct, stride_st,
    X_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < half
    mask = (heads < num_heads)[:, None] & j_ok[None, :]
    first = x_ptr + t * stride_xt + heads[:, None] * stride_xh + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * stride_ct + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * stride_ct + half + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * stride_st + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * stride_st + half + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    if X_BF16:
        y1 = round_to_bf16(y1)
        y2 = round_to_bf16(y2)
    tl.store(first, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, y2.to(x_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """x as [R, D] rows with one row stride: a view where the layout allows, else a copy."""
    check_unit_stride(name, x)
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.shape[0] <= 1 or flat.stride(1) == 1 else flat.contiguous()


def _check_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_tensor("x", x, dtypes=ACTIVATION_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, ndim=1, dtypes=ACTIVATION_DTYPES, device=x.device)
    check_dim("weight", weight.shape[0], x.shape[-1], "length (x's last dim)")
    check_unit_stride("weight", weight)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows("x", x)
    res = rows if residual is None else residual.view(-1, residual.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight, out,
        rows.shape[1], float(eps),
        rows.stride(0), res.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, RES_BF16=res.dtype == torch.bfloat16,
        OUT_BF16=x.dtype == torch.bfloat16, BLOCK_D=next_pow2(rows.shape[1]),
    )  # fmt: skip
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D] -> a new tensor of x's shape and dtype."""
    _check_norm(x, weight, eps)
    return _launch_norm(x, None, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the new residual -> a new tensor of x's dtype.

    ``residual``: contiguous, x's shape, float32 / bfloat16 / float16."""
    _check_norm(x, weight, eps)
    check_tensor("residual", residual, dtypes=ACTIVATION_DTYPES, device=x.device)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (it is updated in place)")
    return _launch_norm(x, residual, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by cos/sin [T, D]; returns x."""
    check_tensor("x", x, ndim=3, dtypes=ACTIVATION_DTYPES)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x's head_dim must be even for rotate-half RoPE, got {head_dim}")
    check_unit_stride("x", x)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=ACTIVATION_DTYPES, device=x.device)
        if tuple(t.shape) != (num_tokens, head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {head_dim}] (tokens, head_dim), got {tuple(t.shape)}")
        check_unit_stride(name, t)
    if num_tokens == 0 or num_heads == 0:
        return x
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        x, cos, sin,
        num_heads, half,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        X_BF16=x.dtype == torch.bfloat16, BLOCK_H=next_pow2(num_heads), BLOCK_HALF=next_pow2(half),
    )  # fmt: skip
    return x


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm rounded once to x's dtype."""
    h = x.double()
    return (weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of the new residual, the new residual ``residual + x`` in residual's dtype); nothing in place."""
    new_residual = (residual.double() + x.double()).to(residual.dtype)
    return reference_rms_norm(new_residual, weight, eps).to(x.dtype), new_residual


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 rotate-half RoPE rounded once to x's dtype; x is left as it is."""
    h = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos.double()[:, None, :] + rotated * sin.double()[:, None, :]).to(x.dtype)
