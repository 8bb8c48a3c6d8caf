"""Pack linear weights for ``kernels/cpu/linear.cpp`` and call it.

A ``PackedWeight`` is one linear layer's weight in the kernel's layout: output
channels in blocks of ``BLOCK_N`` = 4 and, inside a block, K in chunks of 16
values with the block's four channels side by side (int4: 32 values per 16-byte
chunk, low nibbles first). Formats:

* ``float32`` / ``bfloat16``: the weight as it is, reordered;
* ``int8``: symmetric per-output-channel codes, ``w = q * scale``;
* ``int4``: asymmetric groups along K, ``w = q * scale + min`` with q in 0..15.

Those four multiply float32 activations. The integer-dot formats
(``kernels/cpu/int8_dot_linear.cpp``: AVX-512 VNNI, AMX or AVX2) quantize the
activations per block of 32 values to int8 codes plus int8 codes of their
rounding error (~15 bits in all), and multiply codes by codes:

* ``int4_dot``: the int4 codes, scales and mins, laid out for ``vpdpbusd``;
* ``int8_dot``: per-channel int8, stored as unsigned ``q + 128`` with
  ``min = -128 * scale``.

Their scales and mins are float16 (as in GGUF's Q4_1): decode streams every
weight from memory once a step, and float32 metadata costs an int4 group of 32
values 24 bytes instead of 20.

They trade a tiny activation rounding (measured and bounded in the tests)
for 2-4x fewer instructions per weight at decode batch sizes. ``fine=False``
("fast" activation precision) drops the fine codes: one int8 code per value,
as llama.cpp's Q8 activations, half the integer products, a coarser product
(``reference_linear`` models either).

``reference_linear`` computes the same product in plain PyTorch from the
unpacked weight, for tests and for machines without the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from protoserve.kernels.cpu.extension import load

BLOCK_N = 4
CHUNK = 16
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3, "int4_dot": 4, "int8_dot": 5}
DOT_LANES = 16  # output channels per vector in the integer-dot layout
DOT_BLOCK = 32  # activation values per quantization block


@dataclass
class PackedWeight:
    """One layer's weight in the kernel layout (see the module docstring)."""

    format: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor | None = None  # int8: [N]; int4: [blocks, groups, 4]; *_dot: [N/16, groups, 16] float16
    mins: torch.Tensor | None = None  # int4: [blocks, groups, 4]; *_dot: [N/16, groups, 16] float16
    group_size: int = 0  # int4 and the *_dot formats (int8_dot: in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def to(self, device: torch.device) -> PackedWeight:
        """The same pack with its tensors on ``device`` (the Triton kernels read these layouts too)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, data=self.data.to(device), scales=move(self.scales), mins=move(self.mins))


def available() -> bool:
    return load("linear") is not None


def supports(in_features: int) -> bool:
    """The kernel works on 16-value chunks of K."""
    return in_features % CHUNK == 0


def int8_dot_available() -> bool:
    """The integer-dot formats run here: wherever the kernels build (VNNI, AMX or AVX2)."""
    return available()


def int8_dot_amx_available() -> bool:
    """The integer-dot formats run whole 16-row groups on AMX-INT8 tiles here (bit-identical results)."""
    ext = load("linear")
    return ext is not None and ext.int8_dot_amx_available()


def multiplies_in_bf16() -> bool:
    """bfloat16 packs multiply in bfloat16 here (AVX512-BF16): each row of x is rounded to bf16
    once per call, as a bf16 matmul's inputs are, and the products accumulate in float32."""
    ext = load("linear")
    return ext is not None and ext.linear_multiplies_in_bf16()


def supports_int8_dot(in_features: int) -> bool:
    return int8_dot_available() and in_features % DOT_BLOCK == 0


def _pad_rows(t: torch.Tensor, multiple: int = BLOCK_N) -> torch.Tensor:
    """Zero rows appended up to a multiple of ``multiple`` (the kernel's channel block)."""
    n = t.shape[0]
    padded = -(-n // multiple) * multiple
    return t if padded == n else torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])])


def _per_channel_block(t: torch.Tensor, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-channel-and-group values [N, groups] -> [N/width, groups, width] in ``dtype`` (padded channels: 0)."""
    t = _pad_rows(t.float(), width)
    return t.reshape(-1, width, t.shape[1]).transpose(1, 2).to(dtype).contiguous()


def _per_channel(t: torch.Tensor, n: int, repeat: int) -> torch.Tensor:
    """The inverse of ``_per_channel_block`` for the first n channels, each group value repeated
    ``repeat`` times along K: [N/width, groups, width] -> [n, groups * repeat] float32."""
    return t.float().transpose(1, 2).reshape(-1, t.shape[1])[:n].repeat_interleave(repeat, dim=1)


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
    return PackedWeight(
        "int4", n, k, data, _per_channel_block(scales, BLOCK_N), _per_channel_block(mins, BLOCK_N), group_size
    )


def pack_int4_dot(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> PackedWeight:
    """int4 codes [N, K] in 0..15 with scales/mins [N, K/group_size] (``w = q * scale + min``)
    in the integer-dot layout: per 16-channel vector and 32-value block, 4 chunks of 64 bytes,
    chunk j holding k = 8j..8j+3 (low nibbles) and 8j+4..8j+7 (high), channel c at bytes 4c..4c+3."""
    n, k = q.shape
    if k % DOT_BLOCK or group_size % DOT_BLOCK or k % group_size:
        raise ValueError(f"int4_dot needs K ({k}) and the group ({group_size}) to be multiples of 32")
    codes = _pad_rows(q.to(torch.uint8), DOT_LANES)
    nv, blocks = codes.shape[0] // DOT_LANES, k // DOT_BLOCK
    c = codes.reshape(nv, DOT_LANES, blocks, 4, 2, 4)  # [vector, channel, block, chunk, nibble, i]
    packed = c[..., 0, :] | (c[..., 1, :] << 4)  # [vector, channel, block, chunk, i]
    data = packed.permute(0, 2, 3, 1, 4).contiguous()  # [vector, block, chunk, channel, i]
    return PackedWeight(
        "int4_dot",
        n,
        k,
        data,
        _per_channel_block(scales, DOT_LANES, torch.float16),
        _per_channel_block(mins, DOT_LANES, torch.float16),
        group_size,
    )


def pack_int8_dot(q: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """Per-channel int8 codes [N, K] and scales [N] (``w = q * scale``) in the integer-dot layout:
    unsigned ``q + 128``, chunk j of a block holding k = 4j..4j+3, and ``min = -128 * scale``.
    Codes are symmetric, -127..127: the AVX2 kernel multiplies ``q * sign(x)`` in int8, which -128
    does not survive."""
    n, k = q.shape
    if k % DOT_BLOCK:
        raise ValueError(f"int8_dot needs K ({k}) to be a multiple of 32")
    if q.numel() and int(q.min()) < -127:
        raise ValueError("int8_dot codes must lie in -127..127 (symmetric quantization)")
    codes = _pad_rows((q.to(torch.int16) + 128).to(torch.uint8), DOT_LANES)
    nv, blocks = codes.shape[0] // DOT_LANES, k // DOT_BLOCK
    data = codes.reshape(nv, DOT_LANES, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    s = scales.half().float().reshape(n, 1)  # the min from the stored scale: -128 s is then exact in float16 too
    return PackedWeight(
        "int8_dot",
        n,
        k,
        data,
        _per_channel_block(s, DOT_LANES, torch.float16),
        _per_channel_block(-128.0 * s, DOT_LANES, torch.float16),
        k,
    )


def packed_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, fine: bool = True
) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] (any float dtype), float32 result [M, N]. ``fine``: the
    integer-dot formats' fine activation codes (the "exact" activation precision); others ignore it."""
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
        fine,
    )


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the packed form stands for (tests, reference)."""
    n = weight.out_features
    if weight.format in ("float32", "bfloat16"):
        return dense_weight(weight).float()
    if weight.format == "int8":
        return int8_codes(weight).float() * weight.scales[:n, None]
    codes = _dot_codes(weight) if weight.format == "int8_dot" else int4_parts(weight)[0]
    g = weight.group_size  # int8_dot: one group of in_features, min = -128 * scale
    return codes.float() * _per_channel(weight.scales, n, g) + _per_channel(weight.mins, n, g)


def _rows(weight: PackedWeight) -> torch.Tensor:
    """The [N, K] values of a float32 / bfloat16 / int8 pack (``_interleave`` undone, padding cut)."""
    return weight.data.transpose(1, 2).reshape(-1, weight.in_features)[: weight.out_features].contiguous()


def dense_weight(weight: PackedWeight) -> torch.Tensor:
    """The weight [N, K] of a float32 or bfloat16 pack, exactly, in its own dtype."""
    if weight.format not in ("float32", "bfloat16"):
        raise ValueError(f"not a dense pack: {weight.format}")
    return _rows(weight)


def int8_codes(weight: PackedWeight) -> torch.Tensor:
    """The signed per-channel codes [N, K] (int8) of an int8 or int8_dot pack, exactly."""
    if weight.format == "int8":
        return _rows(weight)
    if weight.format == "int8_dot":
        return (_dot_codes(weight).to(torch.int16) - 128).to(torch.int8)
    raise ValueError(f"not an int8 pack: {weight.format}")


def int4_parts(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 or int4_dot pack's codes [N, K] (uint8, 0..15) and its scales and mins
    [N, K / group_size] (float32 holding the stored values), exactly: ``w = q * scale + min``."""
    n, k = weight.out_features, weight.in_features
    if weight.format == "int4_dot":
        codes = _dot_codes(weight)
    elif weight.format == "int4":
        blocks = weight.data.shape[0]
        packed = weight.data.transpose(1, 2).reshape(blocks * BLOCK_N, k // 32, 16)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(-1, k)[:n]
    else:
        raise ValueError(f"not an int4 pack: {weight.format}")
    return codes.contiguous(), _per_channel(weight.scales, n, 1), _per_channel(weight.mins, n, 1)


def _dot_codes(weight: PackedWeight) -> torch.Tensor:
    """The unsigned codes [N, K] (uint8) of an integer-dot pack."""
    n, k = weight.out_features, weight.in_features
    d = weight.data
    if weight.format == "int4_dot":  # [vector, block, chunk, channel, i] -> [vector, channel, block, chunk, nibble, i]
        nib = torch.stack([d & 0xF, d >> 4], dim=4)  # [vector, block, chunk, channel, nibble, i]
        codes = nib.permute(0, 3, 1, 2, 4, 5)
    else:
        codes = d.permute(0, 3, 1, 2, 4)
    return codes.reshape(-1, k)[:n]


def quantize_activations(
    x: torch.Tensor, fine: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer-dot formats' activation rounding: per row and block of 32, coarse codes
    round(x / s) with s = max|x| / 127, plus (``fine``) fine codes round((x - coarse * s) * 256 / s)
    for the rounding error, both clamped to -127..127. Returns (coarse + fine / 256 [M, K] float64,
    scales [M, K/32], exact block sums)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // DOT_BLOCK, DOT_BLOCK)
    amax = xb.abs().amax(dim=-1)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    fine_inv = torch.where(amax > 0, 256.0 / scale, torch.zeros_like(amax))
    coarse = torch.round(xb * inv[..., None]).clamp(-127, 127)
    codes = coarse.double()
    if fine:
        residual = torch.round((xb - coarse * scale[..., None]) * fine_inv[..., None]).clamp(-127, 127)
        codes = codes + residual.double() / 256.0
    return codes.reshape(m, k), scale, xb.double().sum(dim=-1)


def reference_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, fine: bool = True
) -> torch.Tensor:
    """The same product in float64 PyTorch (for the integer-dot formats, of the int8-rounded
    activations, block by block, as the kernel computes it, with or without the fine codes; for
    bfloat16 packs where the kernel multiplies in bf16, of x rounded to bf16), rounded to float32."""
    if weight.format in ("int4_dot", "int8_dot"):
        return _reference_dot(x, weight, bias, fine)
    if weight.format == "bfloat16" and multiplies_in_bf16():
        x = x.bfloat16()
    y = x.double() @ unpack(weight).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def _reference_dot(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, fine: bool) -> torch.Tensor:
    n, k = weight.out_features, weight.in_features
    blocks, per_group = k // DOT_BLOCK, weight.group_size // DOT_BLOCK
    codes, x_scales, x_sums = quantize_activations(x, fine)
    w_codes = _dot_codes(weight).double().reshape(n, blocks, DOT_BLOCK)
    xq = codes.double().reshape(-1, blocks, DOT_BLOCK)
    dots = torch.einsum("mbk,nbk->mnb", xq, w_codes)
    scales = _per_channel(weight.scales, n, per_group).double()  # [N, blocks]
    mins = _per_channel(weight.mins, n, per_group).double()
    y = (dots * scales[None] * x_scales.double()[:, None, :]).sum(-1)
    y = y + (mins[None] * x_sums[:, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.float()
