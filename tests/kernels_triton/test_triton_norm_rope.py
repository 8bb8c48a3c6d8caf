"""kernels/triton/norm_rope.py: RMSNorm, residual-add + RMSNorm and rotate-half RoPE in place.

Against the float64 references (float32: a few float32 ulps; bfloat16 / float16: rounded once,
so at most one ulp of the dtype apart), widths that are not powers of two, RoPE on a strided
view of a fused qkv output (the neighbouring columns untouched), and against the engine's own
``RMSNorm`` and ``apply_rope`` (engine/models/decoder.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import torch  # noqa: E402

from protoserve.engine.models.decoder import RMSNorm  # noqa: E402
from protoserve.engine.models.rope import apply_rope, rope_cos_sin, rope_spec  # noqa: E402
from protoserve.kernels.triton import norm_rope as nr  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def ulp_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """One rounding of a float32 result to ``dtype`` against the float64 one: one ulp of ``dtype``, since a
    float32 value a few float32 ulps from a tie of ``dtype`` can round to the other side (seen on an
    H200, whose sqrt and division differ from the interpreter's numpy in the last float32 bit)."""
    return {
        torch.float32: {"rtol": 2e-6, "atol": 2e-6},
        torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
        torch.float16: {"rtol": 2**-10, "atol": 1e-5},
    }[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("dim", [40, 64])
def test_rms_norm_matches_reference(dim: int, dtype: torch.dtype, device) -> None:
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(3, 5, dim, generator=g) * 3).to(dtype)  # [..., D]: leading dims flattened
    w = (torch.randn(dim, generator=g)).to(dtype)
    out = nr.rms_norm(x.to(device), w.to(device), 1e-6).cpu()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), nr.reference_rms_norm(x, w, 1e-6).float(), **ulp_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_rms_norm_updates_the_residual(dtype: torch.dtype, device) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 48, generator=g).to(dtype)
    residual = torch.randn(6, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    want_out, want_residual = nr.reference_add_rms_norm(x, residual, w, 1e-5)
    res = residual.to(device)
    out = nr.add_rms_norm_(x.to(device), res, w.to(device), 1e-5).cpu()
    torch.testing.assert_close(res.cpu().float(), want_residual.float(), **ulp_tolerance(dtype))
    torch.testing.assert_close(out.float(), want_out.float(), **ulp_tolerance(dtype))


def test_rms_norm_matches_the_engine_module(device) -> None:
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(40, 1e-6, torch.float32)
    norm.weight.data = torch.randn(40, generator=g)
    x = torch.randn(7, 40, generator=g)
    torch.testing.assert_close(
        nr.rms_norm(x.to(device), norm.weight.data.to(device), 1e-6).cpu(), norm(x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rope_in_place_on_a_qkv_view(dtype: torch.dtype, device) -> None:
    """q is a strided view of the fused qkv rows, as the attention layer rotates it."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 5, 3, 1, 24
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 7, 100, 4000])
    cos, sin = rope_cos_sin(positions, rope_spec(head_dim, 10000.0, None, 4096), torch.float32)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    want = nr.reference_rope(q, cos, sin)
    engine = apply_rope(q.float(), cos, sin)
    before = qkv.clone()
    on_device = qkv.clone().to(device)
    q_dev = on_device[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert nr.rope_(q_dev, cos.to(device), sin.to(device)) is q_dev
    after = on_device.cpu()
    torch.testing.assert_close(after[:, : heads * head_dim].view_as(q).float(), want.float(), **ulp_tolerance(dtype))
    assert torch.equal(after[:, heads * head_dim :], before[:, heads * head_dim :])  # k and v untouched
    if dtype == torch.float32:  # the engine's PyTorch rotation
        torch.testing.assert_close(after[:, : heads * head_dim].view_as(q), engine, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_field(device) -> None:
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="weight: length"):
        nr.rms_norm(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="eps must be positive"):
        nr.rms_norm(x, torch.ones(16, device=device), 0.0)
    with pytest.raises(ValueError, match="residual has shape"):
        nr.add_rms_norm_(x, torch.zeros(4, 8, device=device), torch.ones(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        nr.add_rms_norm_(x, torch.zeros(16, 4, device=device).t(), torch.ones(16, device=device), 1e-6)
    q = torch.randn(4, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"cos must be \[4, 16\]"):
        nr.rope_(q, torch.ones(4, 8, device=device), torch.ones(4, 16, device=device))
    with pytest.raises(ValueError, match="head_dim must be even"):
        nr.rope_(torch.randn(4, 2, 15, device=device), torch.ones(4, 15, device=device), torch.ones(4, 15, device=device))
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        nr.rope_(x, torch.ones(4, 16, device=device), torch.ones(4, 16, device=device))
