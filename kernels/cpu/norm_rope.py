"""RMSNorm, residual-add + RMSNorm, and RoPE in one call each (``kernels/cpu/norm_rope.cpp``).

Float32 activations only; callers keep their PyTorch path for other dtypes and
where ``available()`` is False. The ``reference_*`` functions are the PyTorch
definitions the tests compare against.
"""

from __future__ import annotations

import torch

from protoserve.kernels.cpu.extension import load


def available() -> bool:
    return load("norm_rope") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load("norm_rope").rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the new residual."""
    return load("norm_rope").add_rms_norm_(x, residual, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by cos/sin [T, D]; returns x."""
    load("norm_rope").rope_(x, cos, sin)
    return x


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).float()


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
