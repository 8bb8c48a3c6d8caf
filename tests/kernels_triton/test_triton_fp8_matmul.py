"""kernels/triton/fp8_matmul.py: E4M3 weight storage with per-channel scales, and its matmul kernel.

The quantizer against torch's own float8_e4m3fn cast, an independent decode of the E4M3 bit
patterns, hand-picked round-to-nearest-even ties and the format's 2^-4 relative error bound; the
kernel against the float64 product of the dequantized weight over ragged row counts, output
channels that are not a multiple of the column tile, K a multiple of 16 but not of the K step,
bias, and float32 / bfloat16 / float16 activations; a row's output bit-identical alone and inside
a batch; bad arguments refused by name.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import torch  # noqa: E402

from protoserve.kernels.triton.fp8_matmul import (  # noqa: E402
    Fp8Weight,
    dequantize_fp8,
    fp8_matmul,
    quantize_fp8,
    reference_fp8_matmul,
)


def weight_rows(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows whose magnitudes span 1e-3 .. 1e2 (the scale is per row), the third all zero."""
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]
    w[2] = 0.0
    return w


def decode_e4m3(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bit patterns -> float64 by the format's definition, not torch's cast; NaN for 0x7F / 0xFF."""
    b = bits.to(torch.int64)
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0).double()
    exp = (b >> 3) & 0xF
    mant = (b & 0x7).double()
    normal = (1.0 + mant / 8.0) * torch.pow(2.0, (exp - 7).double())
    subnormal = mant / 8.0 * 2.0**-6
    value = sign * torch.where(exp == 0, subnormal, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.nan, value)


def test_quantize_matches_the_torch_cast_and_the_format(device) -> None:
    g = torch.Generator().manual_seed(0)
    w = weight_rows(12, 64, g)
    q = quantize_fp8(w)
    assert q.codes.dtype == torch.float8_e4m3fn and q.codes.shape == (12, 64)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (12,)
    amax = w.abs().amax(dim=1)
    expected_scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.equal(q.scales, expected_scales)
    assert q.scales[2].item() == 1.0 and not q.codes[2].float().any()
    # codes: exactly torch's round-to-nearest-even cast of w / scale (no clamp needed at amax / 448)
    cast = (w / q.scales[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(q.codes.view(torch.uint8), cast.view(torch.uint8))
    # each row's largest weight lands on 448, the largest finite code
    assert torch.equal(q.codes.float().abs().amax(dim=1)[[0, 1, 3]], torch.full((3,), 448.0))
    # dequantized: code * scale, the code read from its bit pattern; every code finite
    decoded = decode_e4m3(q.codes.view(torch.uint8))
    assert torch.isfinite(decoded).all()
    assert torch.equal(dequantize_fp8(q), decoded * q.scales.double()[:, None])
    assert dequantize_fp8(q).dtype == torch.float64


def test_dequantization_error_bounds() -> None:
    g = torch.Generator().manual_seed(1)
    w = weight_rows(16, 256, g)
    q = quantize_fp8(w)
    deq = dequantize_fp8(q)
    err = (deq - w.double()).abs()
    scaled = w.double().abs() / q.scales.double()[:, None]
    normal = scaled >= 2.0**-6  # E4M3's smallest normal
    assert normal.sum() > 0.9 * w.numel() and (~normal).any()
    # 3 mantissa bits, rounded to nearest: half an ulp is 2^-4 of the value or less
    assert (err[normal] <= 2.0**-4 * w.double().abs()[normal]).all()
    # subnormal codes step by 2^-9: half a step times the row's scale
    assert (err[~normal] <= 2.0**-10 * q.scales.double()[:, None].expand_as(w)[~normal]).all()


def test_rounding_ties_to_even_and_bfloat16_weights() -> None:
    # amax 448: scale exactly 1, so w / scale is w and each tie is exact
    row = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, -(2.0**-10), 3 * 2.0**-10, 2.0**-11])
    q = quantize_fp8(row[None, :])
    assert q.scales.item() == 1.0
    # 1.0625: between 1.0 and 1.125 -> 1.0 (even); 1.1875 -> 1.25; 17 -> 16; 19 -> 20;
    # subnormal ties (step 2^-9): -2^-10 -> -0, 3 * 2^-10 -> 2^-8; 2^-11 below half a step -> 0
    expected = [448.0, 1.0, 1.25, 16.0, 20.0, -0.0, 2.0**-8, 0.0]
    assert q.codes.float()[0].tolist() == expected
    wb = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    qb = quantize_fp8(wb)
    assert torch.equal(qb.codes.view(torch.uint8), quantize_fp8(wb.float()).codes.view(torch.uint8))


def test_weight_api(device) -> None:
    q = quantize_fp8(torch.randn(10, 48))
    assert (q.out_features, q.in_features) == (10, 48)
    assert q.nbytes == 10 * 48 + 4 * 10
    moved = q.to(device)
    assert isinstance(moved, Fp8Weight) and moved.device.type == device.type
    assert moved.codes.device.type == device.type and moved.scales.device.type == device.type
    assert torch.equal(moved.codes.cpu().view(torch.uint8), q.codes.view(torch.uint8))


@pytest.mark.parametrize(
    ("k", "dtype", "with_bias"),
    [
        (48, torch.float32, True),
        (64, torch.float32, False),
        (64, torch.bfloat16, True),
        (48, torch.float16, False),
    ],
)
def test_kernel_matches_reference(k: int, dtype: torch.dtype, with_bias: bool, device) -> None:
    g = torch.Generator().manual_seed(k)
    n = 36  # not a multiple of the 32-channel column tile
    w = quantize_fp8(weight_rows(n, k, g) * 0.01)
    bias = torch.randn(n, generator=g) if with_bias else None
    x_all = torch.randn(40, k, generator=g).to(dtype)
    for m in (1, 3, 17, 40):  # within one row tile, across two, a full tile plus a ragged one
        x = x_all[:m]
        out = fp8_matmul(x.to(device), w.to(device), None if bias is None else bias.to(device)).cpu()
        ref = reference_fp8_matmul(x, w, bias)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        # float32 accumulation of exact products over K <= 64, one scale and one bias rounding
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_close_to_the_float_weights(device) -> None:
    """Against the unquantized weights the distance is the quantization error, within its bound."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=g) * 0.05
    x = torch.randn(6, 64, generator=g)
    q = quantize_fp8(w)
    out = fp8_matmul(x.to(device), q.to(device)).cpu().double()
    exact = x.double() @ w.double().T
    bound = x.double().abs() @ (2.0**-4 * w.double().abs() + 2.0**-10 * q.scales.double()[:, None]).T
    assert ((out - exact).abs() <= bound + 1e-5).all()
    assert (out - exact).abs().max() > 0  # the weights were really quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype: torch.dtype, device) -> None:
    g = torch.Generator().manual_seed(7)
    k, n = 64, 40
    w = quantize_fp8(torch.randn(n, k, generator=g)).to(device)
    bias = torch.randn(n, generator=g).to(device)
    x = torch.randn(40, k, generator=g).to(dtype).to(device)
    batch = fp8_matmul(x, w, bias)
    for i in (0, 17, 39):  # first tile, second tile's first row, last tile's last row
        assert torch.equal(fp8_matmul(x[i : i + 1], w, bias), batch[i : i + 1])
    assert torch.equal(fp8_matmul(x[5:22], w, bias), batch[5:22])  # shifted across tile boundaries


def test_bad_arguments_name_the_field(device) -> None:
    g = torch.Generator().manual_seed(0)
    w = quantize_fp8(torch.randn(8, 64, generator=g)).to(device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="x: in_features"):
        fp8_matmul(x[:, :32], w)
    with pytest.raises(ValueError, match="x must be float32"):
        fp8_matmul(x.double(), w)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        fp8_matmul(x[0], w)
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        fp8_matmul(torch.randn(64, 2, device=device).T, w)
    with pytest.raises(ValueError, match="weight must be an Fp8Weight"):
        fp8_matmul(x, torch.randn(8, 64, device=device))
    with pytest.raises(ValueError, match="weight.codes must be float8_e4m3fn"):
        fp8_matmul(x, Fp8Weight(w.codes.view(torch.uint8), w.scales))
    with pytest.raises(ValueError, match="weight.codes must be contiguous"):
        fp8_matmul(x[:, :8], Fp8Weight(w.codes.T, torch.ones(64, device=device)))
    with pytest.raises(ValueError, match="weight.scales: length"):
        fp8_matmul(x, Fp8Weight(w.codes, w.scales[:7]))
    with pytest.raises(ValueError, match="weight.scales must be float32"):
        fp8_matmul(x, Fp8Weight(w.codes, w.scales.half()))
    with pytest.raises(ValueError, match="bias: length"):
        fp8_matmul(x, w, torch.zeros(7, device=device))
    with pytest.raises(ValueError, match="bias must be float32"):
        fp8_matmul(x, w, torch.zeros(8, dtype=torch.int32, device=device))


def test_quantize_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        quantize_fp8(torch.randn(8))
    with pytest.raises(ValueError, match="weight must be float32"):
        quantize_fp8(torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="weight must have at least one row"):
        quantize_fp8(torch.randn(0, 8))
    bad = torch.randn(4, 8)
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="weight has non-finite values"):
        quantize_fp8(bad)
