"""kernels/cpu/norm_rope.cpp against the PyTorch definitions, and per-row invariance."""

from __future__ import annotations

import pytest
import torch

from protoserve.kernels.cpu import extension
from protoserve.kernels.cpu import norm_rope as nr

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")


def test_kernel_loads_on_this_machine() -> None:
    assert nr.available()


@pytest.mark.parametrize("d", [576, 64, 40, 7])
def test_rms_norm_matches_reference(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(33, d, generator=g) * 3, torch.randn(d, generator=g)
    torch.testing.assert_close(nr.rms_norm(x, w, 1e-5), nr.reference_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    # Rows are independent: each alone equals its row of the batch, bit for bit.
    full = nr.rms_norm(x, w, 1e-5)
    assert all(torch.equal(nr.rms_norm(x[i : i + 1], w, 1e-5)[0], full[i]) for i in range(33))


def test_add_rms_norm_updates_residual_in_place() -> None:
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(20, 576, generator=g), torch.randn(20, 576, generator=g)
    w = torch.randn(576, generator=g)
    residual = r.clone()
    out = nr.add_rms_norm_(x, residual, w, 1e-6)
    assert torch.equal(residual, r + x)
    assert torch.equal(out, nr.rms_norm(r + x, w, 1e-6))


def test_rope_equals_pytorch_bit_for_bit_on_strided_views() -> None:
    """In place on q/k views of a fused qkv output, as the decoder calls it."""
    g = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 11, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    q = qkv[:, : heads * d].reshape(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(t, kv_heads, d)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    want_q, want_k = nr.reference_rope(q, cos, sin), nr.reference_rope(k, cos, sin)
    nr.rope_(q, cos, sin)
    nr.rope_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


def test_bad_inputs_raise() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        nr.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="last dim"):
        nr.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        nr.rope_(torch.randn(2, 1, 8), torch.randn(3, 8), torch.randn(3, 8))
