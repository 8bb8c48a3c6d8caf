"""kernels/triton/paged_attention.py: decode attention (one query per sequence) over the paged cache.

Against the float64 reference for GQA ratios 1/2/4 (and a group of 3, not a power of two), windows
on and off, float32 and bfloat16 pools, head sizes that are not powers of two, and contexts
ending just before, on and after block boundaries; then against the chunked-prefill kernel, the
CPU kernel and the engine's PyTorch decode paths on the same engine-built batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import torch  # noqa: E402
from triton_attention_cases import PagedCase, bf16_tolerance, paged_case, strided_rows  # noqa: E402

from protoserve.engine.models.kv_cache import PagedKVCache  # noqa: E402
from protoserve.kernels.cpu import paged_attention as cpu_attention  # noqa: E402
from protoserve.kernels.triton.paged_attention import (  # noqa: E402
    paged_decode_attention,
    reference_paged_decode_attention,
)
from protoserve.kernels.triton.prefill_attention import prefill_attention  # noqa: E402

# One new token per sequence, contexts of 1 (the first token), 4, 5, 6 (around a block of 5), 23.
DECODES = [(n - 1, n) for n in (1, 4, 5, 6, 23)]


def run(case: PagedCase, device: torch.device, window: int | None, strided: bool = False,
        logit_softcap: float | None = None) -> torch.Tensor:
    b = case.batch
    q = strided_rows(case.q.to(device)) if strided else case.q.to(device)
    return paged_decode_attention(
        q, case.k.to(device), case.v.to(device),
        b.block_tables.to(device), b.seq_lens.to(device), case.scale, window, logit_softcap,
    ).cpu()  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 4], ids=["nowin", "win4"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(2, 2, 24), (4, 2, 16), (8, 2, 40), (6, 2, 24)], ids=["gqa1", "gqa2", "gqa4", "gqa3"]
)
def test_matches_reference(
    heads: int, kv_heads: int, head_dim: int, window: int | None, dtype: torch.dtype, device
) -> None:
    case = paged_case(DECODES, heads, kv_heads, head_dim, block_size=5, dtype=dtype, seed=heads + (window or 0))
    b = case.batch
    assert b.query_lens_list == [1] * len(DECODES)
    out = run(case, device, window)
    bf16 = dtype == torch.bfloat16
    ref = reference_paged_decode_attention(
        case.q, case.k, case.v, b.block_tables, b.seq_lens, case.scale, window, round_query=bf16
    )
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=bf16_tolerance(case.v) if bf16 else 2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 4], ids=["nowin", "win4"])
def test_soft_cap_matches_reference(window: int | None, dtype: torch.dtype, device) -> None:
    """Scores ``cap * tanh(scores / cap)`` before the mask, as the reference caps them; the cap matters,
    and a cap of 0 is none (the same bits as no cap)."""
    case = paged_case(DECODES, 8, 2, head_dim=40, block_size=5, dtype=dtype, seed=31)
    b = case.batch
    bf16 = dtype == torch.bfloat16
    capped = run(case, device, window, logit_softcap=1.5)
    ref = reference_paged_decode_attention(case.q, case.k, case.v, b.block_tables, b.seq_lens, case.scale, window,
                                           round_query=bf16, logit_softcap=1.5)
    torch.testing.assert_close(capped, ref, rtol=1e-5, atol=bf16_tolerance(case.v) if bf16 else 2e-5)
    plain = run(case, device, window)
    assert (capped - plain).abs().max().item() > 0.1
    assert torch.equal(run(case, device, window, logit_softcap=0.0), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_agrees_with_the_prefill_kernel(dtype: torch.dtype, device) -> None:
    """A decode batch is a ragged batch of one-row runs: both kernels compute the same thing."""
    case = paged_case(DECODES, 4, 1, head_dim=32, block_size=4, dtype=dtype, seed=2)
    b = case.batch
    for window in (None, 6):
        ragged = prefill_attention(
            case.q.to(device), case.k.to(device), case.v.to(device), b.block_tables.to(device),
            b.query_start_loc.to(device), b.seq_lens.to(device), case.scale, window,
        ).cpu()  # fmt: skip
        torch.testing.assert_close(run(case, device, window), ragged, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="the CPU paged attention kernel does not run here")
def test_matches_the_cpu_kernel(device) -> None:
    case = paged_case(DECODES, 6, 2, head_dim=32, block_size=5, dtype=torch.float32, seed=7)
    b = case.batch
    for window in (None, 4):
        cpu = cpu_attention.paged_attention(
            case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens, case.scale, window
        )
        torch.testing.assert_close(run(case, device, window), cpu, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("deterministic", [True, False], ids=["tiled", "fast"])
def test_matches_the_engine_attention(deterministic: bool, device) -> None:
    """The engine's PyTorch decode paths: the tile plan, and the batched decode plan + SDPA."""
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 5
    case = paged_case(DECODES, heads, kv_heads, head_dim, block_size, torch.float32, seed=9)
    for window in (None, 4):
        cache = PagedKVCache(1, case.k.shape[0], block_size, kv_heads, head_dim, torch.float32, use_kernel=False)
        cache.k[0].copy_(case.k)
        cache.v[0].copy_(case.v)
        meta = cache.prepare(case.batch, num_heads=heads, sliding_window=window, deterministic=deterministic)
        engine = cache.attend(0, case.q, *case.new_kv(), meta, case.scale)
        # q as the engine hands it over: a strided view of the fused qkv rows.
        torch.testing.assert_close(run(case, device, window, strided=True), engine, rtol=1e-5, atol=2e-5)


def test_bad_arguments_name_the_field(device) -> None:
    case = paged_case(DECODES[:2], 2, 1, head_dim=16, block_size=4, dtype=torch.float32, seed=0)
    b = case.batch
    q, k, v = case.q.to(device), case.k.to(device), case.v.to(device)
    tables, lens = b.block_tables.to(device), b.seq_lens.to(device)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="block_tables: rows"):
        paged_decode_attention(q, k, v, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_decode_attention(q, k, v, tables, lens.long(), 1.0)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        paged_decode_attention(q[0], k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="k_cache must be float32, bfloat16"):
        paged_decode_attention(q, k.half(), v.half(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="v_cache has shape"):
        paged_decode_attention(q, k, v[:1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="logit_softcap must be None, 0 \\(no cap\\) or positive"):
        paged_decode_attention(q, k, v, tables, lens, 1.0, logit_softcap=-2.0)
