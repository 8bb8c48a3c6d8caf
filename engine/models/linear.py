"""Linear layers: full precision (batch-invariant or fast) and weight-only int8 / int4.

Batch invariance: a GEMM library picks its kernel, blocking and thread split
from the matrix shape, so one row of ``x @ W.T`` changes in the last bits with
the number of rows around it (measured here: MKL float32 rows differ by ~1e-6
between M<16 and M>=16, and with two threads for K=1536 up to M=56; bfloat16
rows differ for scattered M). In deterministic mode every full-precision GEMM
runs on fixed ``ROW_TILE``-row tiles (zero-padded), so a row's result depends
only on the row itself: the same kernel shape always runs, and within one shape
a row's reduction order does not depend on its position (verified by
tests/models/test_batch_invariance.py).

Where the CPU has AVX-512 or AVX2, every layer runs on our own kernel instead
(kernels/cpu/linear.cpp, packed by ``pack_for_kernel`` once the weights are
final): it reads each weight once per step in its stored width (float32,
bfloat16, int8 or int4) and computes each output as one fixed-order chain per
row, so it is batch invariant by construction, needs no tiling, and is 3-10x
faster than the paths below for the decode batch sizes that dominate serving.

Without the kernel, weight-only quantization uses PyTorch's packed CPU kernels:
``aten._weight_int8pack_mm`` (int8, one scale per output channel) and
``aten._weight_int4pack_mm_for_cpu`` (int4, asymmetric groups along in_features).
Both are row-by-row kernels, so they are batch invariant without tiling. Both
run their fast vectorized path only for bfloat16 activations (float32
activations take a scalar path, 10-80x slower here), so quantized layers compute
in bfloat16 and cast the result back; their scales and zeros are chosen as exact
bfloat16 values before the weights are rounded against them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from protoserve.engine.config import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, QUANTIZATION_MODES
from protoserve.engine.models.device_ops import ops_for
from protoserve.kernels.cpu import packed_linear as kernel

# Rows per GEMM tile in deterministic mode. Any fixed value is invariant. Measured on the
# 2-core CPU (576x1536 float32): one row padded to 16 costs ~5x a GEMV, and a row inside a
# 16-row tile ~2x its share of a 256-row GEMM; smaller tiles are no cheaper for one row
# (MKL's small-M path) and much dearer for prefill, larger ones dearer for decode.
ROW_TILE = 16

# Formats only a device's kernels multiply (engine/models/device_ops.py: DeviceOps.fp8_linear).
DEVICE_ONLY_MODES = ("fp8",)
# The int4 packing kernel interleaves output channels in groups of 16.
INT4_N_MULTIPLE = 16


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int = ROW_TILE
) -> torch.Tensor:
    """``F.linear`` computed on fixed ``tile``-row blocks: each row's result is independent of the batch."""
    rows = x.shape[0]
    padded = -(-rows // tile) * tile
    # A fresh zero-padded buffer keeps every tile's start 64-byte aligned as well.
    xp = x.new_zeros(padded, x.shape[1])
    xp[:rows] = x
    out = x.new_empty(padded, weight.shape[0])
    wt = weight.t()
    for start in range(0, padded, tile):
        if bias is None:
            torch.mm(xp[start : start + tile], wt, out=out[start : start + tile])
        else:
            torch.addmm(bias, xp[start : start + tile], wt, out=out[start : start + tile])
    return out[:rows]


class KernelPackable(nn.Module, ABC):
    """A linear layer that can move onto the CPU kernel once its weights are final.

    ``pack_for_kernel`` checks, in one place for all formats, that the kernel runs here and takes
    this layer's in_features; each subclass says in ``_kernel_pack`` how its weights pack.
    """

    in_features: int

    def __init__(self) -> None:
        super().__init__()
        self.packed: kernel.PackedWeight | None = None
        self.released = False  # the PyTorch path's weights were dropped once packed
        # The integer-dot packs' activation precision (Decoder.set_activation_precision): fine codes of
        # the activations' rounding error ("exact") or the coarse int8 codes alone ("fast"). Float packs
        # and the PyTorch paths multiply float activations and ignore it.
        self.fine_activations = True

    def pack_for_kernel(self, release: bool = False) -> bool:
        """Copy the (final) weights into the kernel's layout; False where the kernel cannot run them.

        ``release`` then drops the PyTorch path's own copy of the weights, which the model would
        otherwise hold twice; ``unpack_from_kernel`` rebuilds it exactly from the pack.
        """
        if not (kernel.available() and kernel.supports(self.in_features)):
            return False
        if self.packed is None:  # packing again keeps the pack: a released layer has nothing else
            packed = self._kernel_pack()
            if packed is None:
                return False
            self.packed = packed
        if release and not self.released:
            self._release_unpacked()
            self.released = True
        return True

    def unpack_from_kernel(self) -> None:
        """Back onto the PyTorch path: the weights rebuilt from the pack if they were released, the pack dropped."""
        if self.packed is None:
            return
        if self.released:
            self._restore_unpacked(self.packed)
            self.released = False
        self.packed = None

    def pack_for_device(self, device: torch.device) -> None:
        """Onto a GPU (instead of ``pack_for_kernel``): a quantized layer's codes repacked in the plain
        int8/int4 layout the device's kernels read, on the device, the PyTorch path's copy dropped;
        a float layer keeps its weights, which move with the module."""
        pack = self._portable_pack()
        if pack is None:
            return
        self.packed = pack.to(device)
        if not self.released:
            self._release_unpacked()
            self.released = True

    def _portable_pack(self) -> kernel.PackedWeight | None:
        """The weights in a layout every device's kernels read (int8 / int4, not the CPU's integer-dot
        ones); None for float weights, which need no pack."""
        return None

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` in float32 by the kernel of x's device over this layer's pack."""
        return ops_for(x.device).packed_linear(x, self.packed, self.bias, self.fine_activations)

    @abstractmethod
    def _kernel_pack(self) -> kernel.PackedWeight | None:
        """This layer's final weights in the kernel layout, or None when it has nothing to pack from."""

    @abstractmethod
    def _release_unpacked(self) -> None:
        """Drop the tensors only the PyTorch path reads."""

    @abstractmethod
    def _restore_unpacked(self, packed: kernel.PackedWeight) -> None:
        """Rebuild what ``_release_unpacked`` dropped, bit for bit, from this layer's pack."""


class Linear(KernelPackable):
    """``y = x @ W.T + b`` on 2-D input, batch-invariant when ``deterministic`` is set."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.deterministic = True

    def _kernel_pack(self) -> kernel.PackedWeight:
        return kernel.pack_dense(self.weight.detach())

    def _release_unpacked(self) -> None:
        self.weight = None

    def _restore_unpacked(self, packed: kernel.PackedWeight) -> None:
        self.weight = nn.Parameter(kernel.dense_weight(packed), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._packed_forward(x).to(x.dtype)
        if self.deterministic:
            return tiled_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


# ---------------------------------------------------------------------------
# int8: symmetric, one scale per output channel


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: returns (q [N, K] int8, scales [N] bfloat16), w ~ q * scale."""
    w = weight.float()
    absmax = w.abs().amax(dim=1).clamp(min=1e-8)
    # Round the scale up to a bfloat16 value so the kernel's scale is exact and |w/scale| <= 127.
    scales = _bf16_round_up(absmax / 127.0)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


class Int8Linear(KernelPackable):
    """Weight-only int8 linear over ``aten._weight_int8pack_mm`` (bfloat16 compute)."""

    def __init__(
        self,
        weight_int8: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype).clone())
        self.out_dtype = out_dtype
        self.deterministic = True  # the kernel is row-by-row: invariant either way

    def _kernel_pack(self) -> kernel.PackedWeight:
        if kernel.supports_int8_dot(self.in_features):  # VNNI: codes times int8-rounded activations
            return kernel.pack_int8_dot(self.weight_int8, self.scales.float())
        return kernel.pack_int8(self.weight_int8, self.scales.float())

    def _portable_pack(self) -> kernel.PackedWeight:
        return kernel.pack_int8(self.weight_int8, self.scales.float())

    def _release_unpacked(self) -> None:
        self.weight_int8 = None  # the per-channel scales stay: N values, and the bfloat16 originals

    def _restore_unpacked(self, packed: kernel.PackedWeight) -> None:
        self.weight_int8 = kernel.int8_codes(packed)

    @classmethod
    def from_linear(cls, linear: Linear) -> Int8Linear:
        q, scales = quantize_int8(linear.weight.detach())
        return cls(q, scales, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:  # float32 activations: no bfloat16 rounding on this path
            return self._packed_forward(x).to(self.out_dtype)
        y = torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16).contiguous(), self.weight_int8, self.scales
        )
        y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel"


# ---------------------------------------------------------------------------
# int4: asymmetric groups of `group_size` input columns, packed for the CPU kernel


def check_int4_shape(out_features: int, in_features: int, group_size: int, name: str = "linear") -> None:
    """Raise ValueError when the int4 kernel cannot take this weight with this group size."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} does not divide in_features={in_features} of {name}; "
            f"use a group size that divides it (one of {[g for g in INT4_GROUP_SIZES if in_features % g == 0]})"
        )
    if out_features % INT4_N_MULTIPLE:
        raise ValueError(
            f"int4 packing needs out_features divisible by {INT4_N_MULTIPLE}, {name} has {out_features}"
        )


@dataclass(frozen=True)
class Int4Grid:
    """A checkpoint's own int4 grid for one layer (GPTQ/AWQ: ``(q - zero) * scale``, so min is
    ``-zero * scale``): float16 scales and mins [N, K/group_size], which ``quantize_int4`` then uses
    instead of choosing its own, so the codes are the checkpoint's."""

    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int


def quantize_int4(
    weight: torch.Tensor, group_size: int, grid: Int4Grid | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4 in GGUF Q4_1's form, the CPU kernels' own: ``w ~ q * scale + min``.

    Returns (q [N, K] int32 in 0..15, scales [N, K/group] float16, mins [N, K/group] float16): the
    scale (max - min) / 15 and the min rounded to float16 (what the kernels store) before the codes
    are chosen against them. Weights that came from 4-bit GGUF blocks of 32 (Q4_1, Q4_0: each block
    spans codes 0..15 of a float16 scale and min) come back exactly at group 32. (A bfloat16 scale and
    zero, gpt-fast's form, cost SmolLM2's served int4 a mean |logit error| of 0.19 against 0.06.)
    ``grid`` (same group size) gives the scales and mins; the weights are rounded onto it.
    """
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    w = weight.float().reshape(n, k // group_size, group_size)
    if grid is not None:
        if grid.group_size != group_size or tuple(grid.scales.shape) != (n, k // group_size):
            raise ValueError(f"an int4 grid of group size {grid.group_size} and shape {list(grid.scales.shape)} "
                             f"does not fit a [{n}, {k}] weight in groups of {group_size}")
        scales, mins = grid.scales.to(torch.float16), grid.mins.to(torch.float16)
        lo = mins.float()
    else:
        lo = w.amin(dim=-1)
        scales = ((w.amax(dim=-1) - lo) / 15.0).to(torch.float16)
        mins = lo.to(torch.float16)
    step = torch.where(scales > 0, scales.float(), torch.ones_like(lo))  # a constant group: every code 0
    q = torch.round((w - mins.float()[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, mins


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    w = q.float().reshape(n, k // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, k)


class Int4Linear(KernelPackable):
    """Weight-only grouped int4 linear, one set of codes (``quantize_int4``) on two paths: the CPU
    kernels once packed (``q * scale + min``, float16 metadata, as GGUF Q4_1), else
    ``aten._weight_int4pack_mm_for_cpu`` (bfloat16 compute, the metadata rounded to bfloat16)."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        in_features: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ):
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = in_features
        self.group_size = group_size
        self.register_buffer("weight_int4", packed)  # [N, K/2] uint8, two codes per byte
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype).clone())
        self.out_dtype = out_dtype
        self.deterministic = True  # the kernel is row-by-row: invariant either way
        # quantize_int4's (codes, scales, mins), kept until pack_for_kernel
        self._kernel_form: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _kernel_pack(self) -> kernel.PackedWeight | None:
        if self._kernel_form is None:  # built without it (not by from_linear): nothing to pack from
            return None
        q, scales, mins = self._kernel_form
        pack = kernel.pack_int4_dot if kernel.supports_int8_dot(self.in_features) else kernel.pack_int4
        packed = pack(q, scales.float(), mins.float(), self.group_size)
        self._kernel_form = None
        return packed

    def _portable_pack(self) -> kernel.PackedWeight:
        if self._kernel_form is None:
            raise ValueError("this int4 layer was built without its codes (not by from_linear): it cannot be "
                             "repacked for a device")
        q, scales, mins = self._kernel_form
        self._kernel_form = None
        return kernel.pack_int4(q, scales.float(), mins.float(), self.group_size)

    def _release_unpacked(self) -> None:
        self.weight_int4 = None
        self.scales_and_zeros = None

    def _restore_unpacked(self, packed: kernel.PackedWeight) -> None:
        q, scales, mins = kernel.int4_parts(packed)  # the stored float16 values, as quantize_int4 gave them
        self.weight_int4, scales_and_zeros = _torch_int4_form(q.to(torch.int32), scales, mins)
        self.scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()
        self._kernel_form = (q, scales.half(), mins.half())

    @classmethod
    def from_linear(
        cls, linear: Linear, group_size: int, name: str = "linear", grid: Int4Grid | None = None
    ) -> Int4Linear:
        check_int4_shape(linear.out_features, linear.in_features, group_size, name)
        q, scales, mins = quantize_int4(linear.weight.detach(), group_size, grid)
        packed, scales_and_zeros = _torch_int4_form(q, scales, mins)
        layer = cls(packed, scales_and_zeros, group_size, linear.in_features, linear.bias, linear.weight.dtype)
        layer._kernel_form = (q, scales, mins)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._packed_forward(x).to(self.out_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.weight_int4, self.group_size, self.scales_and_zeros
        )
        y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group={self.group_size}"


# ---------------------------------------------------------------------------
# fp8: E4M3 codes, one scale per output channel, on the GPU path (kernels/triton/fp8_matmul.py)


class Fp8Linear(nn.Module):
    """Weight-only FP8 (E4M3) linear: codes [N, K] and per-channel float32 scales as buffers (they move
    with the module), multiplied by the device's fp8 kernel; no device without one serves it."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype).clone())
        self.out_dtype = out_dtype
        self.deterministic = True  # fixed tiles, K never split: invariant either way

    @classmethod
    def from_linear(cls, linear: Linear) -> Fp8Linear:
        from protoserve.kernels.triton.fp8_matmul import quantize_fp8

        w = quantize_fp8(linear.weight.detach())
        return cls(w.codes, w.scales, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8_linear = ops_for(x.device).fp8_linear
        if fp8_linear is None:
            raise RuntimeError(f"FP8 weights have no kernel on {x.device}: serve them on device cuda")
        return fp8_linear(x.contiguous(), self.codes, self.scales, self.bias).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 per-channel"


def _torch_int4_form(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._weight_int4pack_mm_for_cpu``'s operands for codes [N, K] (int32) with scales and mins
    [N, groups]: the packed codes and scales_and_zeros [groups, N, 2]. The op reads
    (q - 8) * scale + zero with both in bfloat16: the same codes, its zero the value of code 8."""
    scales_and_zeros = torch.stack([scales.float(), mins.float() + 8.0 * scales.float()], dim=-1)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.transpose(0, 1)


def _bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= x (x > 0), so a scale never shrinks below what the range needs."""
    b = x.to(torch.bfloat16)
    return torch.where(b.float() < x, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


# ---------------------------------------------------------------------------
# Whole-model quantization and byte accounting


@dataclass
class QuantizationReport:
    """Bytes of the linear layers' weights (and biases, scales, zeros) before and after quantization."""

    mode: str
    group_size: int | None
    num_layers_quantized: int
    linear_bytes_before: int
    linear_bytes_after: int


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's own parameters and buffers."""
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_linears(
    model: nn.Module,
    mode: str,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    skip: tuple[str, ...] = ("lm_head",),
    head_int8: bool = False,
    int4_grids: Mapping[str, Int4Grid] | None = None,
) -> QuantizationReport:
    """Replace every ``Linear`` (except names in ``skip``) by its int8/int4/fp8 form, in place.

    ``head_int8`` also turns a skipped ``lm_head`` into int8 (counted in no byte total of the report).
    ``int4_grids``: by module name, the grids a layer's weights came from (a GPTQ/AWQ checkpoint);
    int4 in their group size keeps them, so the layer serves the checkpoint's own codes.

    All layers are checked before any is replaced, so a bad group size leaves the model untouched.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and name not in skip]
    # A layer whose weights were released after packing holds them in its pack.
    before = sum(module_bytes(m) + (m.packed.nbytes if m.released else 0) for _, m in targets)
    if mode == "none":
        return QuantizationReport(mode, None, 0, before, before)
    if mode == "int4":
        for name, m in targets:
            check_int4_shape(m.out_features, m.in_features, group_size, name)
    for _, m in targets:  # quantize from the float weights (rebuilt from the pack where released)
        m.unpack_from_kernel()
    after = 0
    if getattr(model, "fused_step", None) is not None:  # bound to the weights being replaced
        model.fused_step = None
    if head_int8 and isinstance(getattr(model, "lm_head", None), Linear):
        # The LM head reads vocab x hidden weights every step (a quarter of SmolLM2's bytes); int8
        # per channel, as llama.cpp keeps the output layer at 8 bits under 4-bit layers. A tied
        # embedding keeps its float table for the lookup.
        model.lm_head.unpack_from_kernel()
        model.lm_head = Int8Linear.from_linear(model.lm_head)
    for name, m in targets:
        if mode == "fp8":
            q: nn.Module = Fp8Linear.from_linear(m)
        elif mode == "int8":
            q = Int8Linear.from_linear(m)
        else:
            grid = (int4_grids or {}).get(name)
            q = Int4Linear.from_linear(m, group_size, name, grid if grid and grid.group_size == group_size else None)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, q)
        after += module_bytes(q)
    return QuantizationReport(mode, group_size if mode == "int4" else None, len(targets), before, after)
