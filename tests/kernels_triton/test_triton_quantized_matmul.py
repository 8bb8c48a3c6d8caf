"""kernels/triton/quantized_matmul.py: weight-only int8 / int4 matmul from the CPU path's own packs.

Every quantized pack format (int8, int4, int8_dot, int4_dot) against the float64 product of the
pack's unpacked values, across int4 group sizes, output channels that are not a multiple of the
pack's channel block or of the kernel's column tile, K not a multiple of the 32-value step (int8),
and row counts across the row tile; with and without bias. The packs come from the engine's own
quantizers (``quantize_int8`` / ``quantize_int4``) and from raw codes covering 0..15 / -127..127,
and the int8 / int4 results are also checked against the CPU kernel on the same packs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import dataclasses  # noqa: E402

import torch  # noqa: E402

from protoserve.engine.models.linear import quantize_int4, quantize_int8  # noqa: E402
from protoserve.kernels.cpu import packed_linear as pl  # noqa: E402
from protoserve.kernels.triton.quantized_matmul import (  # noqa: E402
    quantized_matmul,
    reference_quantized_matmul,
)


def on(device: torch.device, weight: pl.PackedWeight) -> pl.PackedWeight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dataclasses.replace(weight, data=move(weight.data), scales=move(weight.scales), mins=move(weight.mins))


def raw_int4(n: int, k: int, group: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half().float()
    mins = (torch.randn(n, k // group, generator=g) * 0.5).half().float()
    return q, scales, mins


def check(x: torch.Tensor, weight: pl.PackedWeight, bias: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    out = quantized_matmul(x.to(device), on(device, weight), None if bias is None else bias.to(device)).cpu()
    ref = reference_quantized_matmul(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], weight.out_features)
    # float32 accumulation over K of products up to |x| |w|: far below 1e-4 relative at these sizes
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    return out


@pytest.mark.parametrize("fmt", ["int4", "int4_dot"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matches_reference(fmt: str, group: int, device) -> None:
    g = torch.Generator().manual_seed(group)
    n, k = 36, 128  # 36: not a multiple of 16 (int4_dot pads) nor of the column tile
    pack = pl.pack_int4 if fmt == "int4" else pl.pack_int4_dot
    weight = pack(*raw_int4(n, k, group, g), group)
    x = torch.randn(17, k, generator=g)  # two row tiles, the second with one row
    bias = torch.randn(n, generator=g)
    check(x, weight, bias, device)
    check(x[:3], weight, None, device)


@pytest.mark.parametrize("fmt", ["int8", "int8_dot"])
def test_int8_matches_reference(fmt: str, device) -> None:
    g = torch.Generator().manual_seed(8)
    n, k = 20, 48 if fmt == "int8" else 64  # int8: K = 48, a multiple of 16 but not of the 32-value step
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.02 + 0.001).bfloat16().float()
    weight = pl.pack_int8(q, scales) if fmt == "int8" else pl.pack_int8_dot(q, scales)
    x = torch.randn(5, k, generator=g).bfloat16()  # bfloat16 activations are widened exactly
    check(x, weight, torch.randn(n, generator=g), device)


def test_engine_quantizers_end_to_end(device) -> None:
    """Weights through the engine's quantize_int4 / quantize_int8: the product stays close to the
    float weights' (the quantization error, not the kernel, sets the distance)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    x = torch.randn(4, 64, generator=g)
    exact = x @ w.T
    q, s, m = quantize_int4(w, 32)
    for weight in (pl.pack_int4(q, s.float(), m.float(), 32), pl.pack_int4_dot(q, s.float(), m.float(), 32)):
        out = check(x, weight, None, device)
        assert (out - exact).abs().max().item() < 0.1 * exact.abs().max().item()
    q8, s8 = quantize_int8(w)
    out = check(x, pl.pack_int8(q8, s8.float()), None, device)
    assert (out - exact).abs().max().item() < 0.02 * exact.abs().max().item()


@pytest.mark.skipif(not pl.available(), reason="the CPU linear kernel does not run here")
def test_matches_the_cpu_kernel_on_the_same_packs(device) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=g)
    bias = torch.randn(24, generator=g)
    q8 = torch.randint(-127, 128, (24, 96), generator=g, dtype=torch.int8)
    packs = [pl.pack_int4(*raw_int4(24, 96, 32, g), 32), pl.pack_int8(q8, torch.rand(24, generator=g) * 0.01)]
    for weight in packs:
        out = check(x, weight, bias, device)
        torch.testing.assert_close(out, pl.packed_linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_bad_arguments_name_the_field(device) -> None:
    g = torch.Generator().manual_seed(0)
    weight = on(device, pl.pack_int4(*raw_int4(8, 64, 32, g), 32))
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="x: in_features"):
        quantized_matmul(x[:, :32], weight)
    with pytest.raises(ValueError, match="weight.format must be one of"):
        quantized_matmul(x, on(device, pl.pack_dense(torch.randn(8, 64))))
    with pytest.raises(ValueError, match="weight.data of a int4 pack"):
        quantized_matmul(x, dataclasses.replace(weight, data=weight.data[:1]))
    with pytest.raises(ValueError, match="weight.group_size"):
        quantized_matmul(x, dataclasses.replace(weight, group_size=48))
    with pytest.raises(ValueError, match="weight.mins of a int4 pack"):
        quantized_matmul(x, dataclasses.replace(weight, mins=weight.mins[:, :1]))
    with pytest.raises(ValueError, match="bias: length"):
        quantized_matmul(x, weight, torch.zeros(7, device=device))
    with pytest.raises(ValueError, match="x must be float32"):
        quantized_matmul(x.double(), weight)
