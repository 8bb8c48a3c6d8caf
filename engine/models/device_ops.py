"""Which kernel runs each of the model's fused operations, chosen by the tensors' device.

The decoder, its linear layers and the paged KV cache ask ``ops_for(tensor.device)`` and call what it
gives: the C++ kernels of kernels/cpu for CPU tensors (where this CPU builds them), the Triton
kernels of kernels/triton for CUDA tensors. An operation a table leaves out (None) runs on the
decoder's plain PyTorch path, which works on any device. The table is the only place a device
type is looked at below the engine (engine/execution/device.py picks the device itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.kernels.cpu import norm_rope as cpu_norm_rope
from protoserve.kernels.cpu import packed_linear as cpu_linear
from protoserve.kernels.cpu import paged_attention as cpu_attention
from protoserve.kernels.cpu.packed_linear import PackedWeight

# (q, k_pool, v_pool, batch, scale, sliding_window, logit_softcap) -> [T, H, D] float32 or q's dtype
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, float, "int | None",
                           "float | None"], torch.Tensor]


@dataclass(frozen=True)
class DeviceOps:
    """One device's kernels; None: that operation takes the PyTorch path."""

    name: str
    norm_dtypes: tuple[torch.dtype, ...]  # activation dtypes the norm/RoPE kernels take
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None
    # (x, residual, weight, eps): residual += x in place, then RMSNorm of it
    add_rms_norm_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None
    rope_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None  # in place
    # (x, pack, bias, fine activations) -> float32 [M, N]; packs as ``pack_layout`` builds them
    packed_linear: Callable[[torch.Tensor, PackedWeight, torch.Tensor | None, bool], torch.Tensor] | None
    # "cpu": the CPU's own layouts (integer-dot where it has VNNI/AMX); "portable": the plain int8/int4
    # packs every Triton format reads; dense layers stay unpacked (the device's GEMM library multiplies them).
    pack_layout: str
    paged_attention: PagedAttention | None
    kv_dtypes: tuple[torch.dtype, ...]  # pool dtypes paged_attention takes
    # paged_attention soft-caps scores (Gemma 2); False: it is given no cap, and a capped model
    # attends on the PyTorch tiles instead
    attention_softcap: bool = False
    # (x, E4M3 codes [N, K], per-channel scales [N], bias) -> float32 [M, N]; None: no FP8 weights here
    fp8_linear: Callable[..., torch.Tensor] | None = None
    # (x, w_gate_up [E, 2I, H], w_down [E, H, I], expert ids [T, k], routing weights [T, k]) -> float32
    # [T, H]: float experts stacked; None: the grouped PyTorch pass over each expert's layers
    fused_moe: Callable[..., torch.Tensor] | None = None

    def norm_kernel(self, x: torch.Tensor) -> bool:
        """The norm/RoPE kernels take x (one implementation per dtype and device: one result)."""
        return self.rms_norm is not None and x.dtype in self.norm_dtypes


def _cpu_attention(q, k_pool, v_pool, batch: ForwardBatch, scale: float, window: int | None,
                   softcap: float | None) -> torch.Tensor:
    assert softcap is None, "the CPU kernel has no soft cap (DeviceOps.attention_softcap)"
    return cpu_attention.paged_attention(q, k_pool, v_pool, batch.block_tables, batch.query_start_loc,
                                         batch.seq_lens, scale, window)


def _cpu_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Partial rotary (Phi-4-mini): the kernel rotates the leading dims of a view, whose strides it follows.
    cpu_norm_rope.rope_(x[..., : cos.shape[-1]], cos, sin)
    return x


@functools.cache
def _cpu_ops() -> DeviceOps:
    norms = cpu_norm_rope.available()
    return DeviceOps(
        name="cpu",
        norm_dtypes=(torch.float32,),
        rms_norm=cpu_norm_rope.rms_norm if norms else None,
        add_rms_norm_=cpu_norm_rope.add_rms_norm_ if norms else None,
        rope_=_cpu_rope_ if norms else None,
        packed_linear=cpu_linear.packed_linear if cpu_linear.available() else None,
        pack_layout="cpu",
        paged_attention=_cpu_attention if cpu_attention.available() else None,
        kv_dtypes=(torch.float32, torch.bfloat16, torch.int8),
    )


def _triton_attention(q, k_pool, v_pool, batch: ForwardBatch, scale: float, window: int | None,
                      softcap: float | None) -> torch.Tensor:
    from protoserve.kernels.triton.paged_attention import paged_decode_attention
    from protoserve.kernels.triton.prefill_attention import prefill_attention

    longest = max(batch.query_lens_list)
    if longest == 1:  # every sequence decodes one token: rows are sequences, in order
        return paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.seq_lens, scale, window,
                                      softcap)
    return prefill_attention(q, k_pool, v_pool, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                             scale, window, max_query_len=longest, logit_softcap=softcap)


def _triton_linear(x: torch.Tensor, pack: PackedWeight, bias: torch.Tensor | None, fine: bool) -> torch.Tensor:
    # bfloat16 activations times the raw codes on the tensor cores (float32 accumulation), as for FP8:
    # no activation codes, so both activation precisions give this one result.
    from protoserve.kernels.triton.quantized_matmul import quantized_matmul

    return quantized_matmul(x.to(torch.bfloat16).contiguous(), pack, bias)


def _triton_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from protoserve.kernels.triton import norm_rope

    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return norm_rope.rope_(x, cos.contiguous(), sin.contiguous())
    # Partial rotary (the kernel rotates whole heads): the leading dims in PyTorch, in place.
    from protoserve.engine.models.rope import apply_rope

    x[..., :rotary] = apply_rope(x[..., :rotary], cos, sin)
    return x


def _triton_fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    from protoserve.kernels.triton.fp8_matmul import Fp8Weight, fp8_matmul

    # bfloat16 activations: the E4M3 codes are exact in bf16, so the kernel takes the tensor cores' bf16
    # dot (float32 accumulation), 2.3-8x faster on an H200 than its IEEE float32 one (bench/README.md);
    # the activations' rounding (2^-9) is far below the codes' own (2^-4).
    return fp8_matmul(x.to(torch.bfloat16), Fp8Weight(codes, scales), bias)


@functools.cache
def _triton_ops() -> DeviceOps:
    from protoserve.kernels.triton import norm_rope
    from protoserve.kernels.triton.moe import fused_moe

    return DeviceOps(
        name="triton",
        norm_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        rms_norm=norm_rope.rms_norm,
        add_rms_norm_=norm_rope.add_rms_norm_,
        rope_=_triton_rope_,
        packed_linear=_triton_linear,
        pack_layout="portable",
        paged_attention=_triton_attention,
        kv_dtypes=(torch.float32, torch.bfloat16),
        attention_softcap=True,
        fp8_linear=_triton_fp8_linear,
        fused_moe=fused_moe,
    )


# Device types whose tensors the Triton kernels serve. The tests add "cpu" to run the GPU path's whole
# model on CPU tensors under TRITON_INTERPRET=1.
TRITON_DEVICE_TYPES = frozenset({"cuda"})


def ops_for(device: torch.device) -> DeviceOps:
    """The kernels for tensors on ``device``."""
    return _triton_ops() if device.type in TRITON_DEVICE_TYPES else _cpu_ops()
