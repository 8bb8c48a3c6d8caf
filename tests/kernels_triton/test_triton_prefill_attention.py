"""kernels/triton/prefill_attention.py: ragged chunked-prefill attention over the paged cache.

Against the float64 reference for GQA ratios 1/2/4, windows on and off, float32 and bfloat16
pools, a block size that is neither a power of two nor a divisor of the key tiles, and a batch
mixing whole prompts, prompt chunks and single-token decodes whose contexts cross block
boundaries; then against the CPU kernel and the engine's own PyTorch attention paths
(``PagedKVCache`` tiled and fast), so the GPU path keeps the engine's semantics.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import torch  # noqa: E402
from triton_attention_cases import PagedCase, bf16_tolerance, paged_case, strided_rows  # noqa: E402

from protoserve.engine.models.kv_cache import PagedKVCache  # noqa: E402
from protoserve.kernels.cpu import paged_attention as cpu_attention  # noqa: E402
from protoserve.kernels.triton.prefill_attention import (  # noqa: E402
    prefill_attention,
    reference_prefill_attention,
)

# (cached, context after the step): a whole prompt, a chunk in the middle, decodes at and just
# past a block boundary, a chunk ending exactly on one.
SPANS = [(0, 11), (7, 26), (11, 12), (12, 13), (1, 8), (0, 1)]


def run(case: PagedCase, device: torch.device, window: int | None, strided: bool = False, **kwargs) -> torch.Tensor:
    b = case.batch
    q = strided_rows(case.q.to(device)) if strided else case.q.to(device)
    return prefill_attention(
        q, case.k.to(device), case.v.to(device),
        b.block_tables.to(device), b.query_start_loc.to(device), b.seq_lens.to(device),
        case.scale, window, **kwargs,
    ).cpu()  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5], ids=["nowin", "win5"])
@pytest.mark.parametrize("heads,kv_heads", [(1, 1), (2, 1), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_matches_reference(heads: int, kv_heads: int, window: int | None, dtype: torch.dtype, device) -> None:
    case = paged_case(SPANS, heads, kv_heads, head_dim=24, block_size=5, dtype=dtype, seed=heads + (window or 0))
    out = run(case, device, window)
    b = case.batch
    bf16 = dtype == torch.bfloat16
    ref = reference_prefill_attention(
        case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens, case.scale, window, round_query=bf16
    )
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=bf16_tolerance(case.v) if bf16 else 2e-5)
    if bf16:  # the rounding is real: the unrounded contract is measurably further away
        exact = reference_prefill_attention(
            case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens, case.scale, window
        )
        assert (out - exact).abs().max().item() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5], ids=["nowin", "win5"])
def test_soft_cap_matches_reference(window: int | None, dtype: torch.dtype, device) -> None:
    """Gemma 2's ``cap * tanh(scores / cap)`` before the mask: against the float64 reference with the
    same cap; the cap changes the result, and a cap of 0 is none (the same bits as no cap)."""
    case = paged_case(SPANS, 4, 2, head_dim=24, block_size=5, dtype=dtype, seed=23)
    b = case.batch
    bf16 = dtype == torch.bfloat16
    capped = run(case, device, window, logit_softcap=1.5)
    ref = reference_prefill_attention(case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens,
                                      case.scale, window, round_query=bf16, logit_softcap=1.5)
    torch.testing.assert_close(capped, ref, rtol=1e-5, atol=bf16_tolerance(case.v) if bf16 else 2e-5)
    plain = run(case, device, window)
    assert (capped - plain).abs().max().item() > 0.1
    assert torch.equal(run(case, device, window, logit_softcap=0.0), plain)


def test_window_changes_the_result(device) -> None:
    """The window must actually cut keys: with it off, the long sequences' outputs differ."""
    case = paged_case(SPANS, 2, 1, head_dim=16, block_size=4, dtype=torch.float32, seed=3)
    full = run(case, device, None)
    assert (full - run(case, device, 3)).abs().max().item() > 1e-3
    # A window as long as the longest context is no window at all.
    torch.testing.assert_close(run(case, device, 26), full, rtol=1e-6, atol=1e-6)


def test_long_query_run_spans_several_row_tiles(device) -> None:
    """40 new rows: three 16-row tiles of one sequence beside a decode."""
    case = paged_case([(3, 43), (20, 21)], 4, 1, head_dim=32, block_size=16, dtype=torch.float32, seed=5)
    b = case.batch
    for window in (None, 7):
        ref = reference_prefill_attention(
            case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens, case.scale, window
        )
        torch.testing.assert_close(run(case, device, window, max_query_len=40), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="the CPU paged attention kernel does not run here")
@pytest.mark.parametrize("window", [None, 5], ids=["nowin", "win5"])
def test_matches_the_cpu_kernel(window: int | None, device) -> None:
    case = paged_case(SPANS, 4, 2, head_dim=32, block_size=5, dtype=torch.float32, seed=11)
    b = case.batch
    cpu = cpu_attention.paged_attention(
        case.q, case.k, case.v, b.block_tables, b.query_start_loc, b.seq_lens, case.scale, window
    )
    torch.testing.assert_close(run(case, device, window), cpu, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("deterministic", [True, False], ids=["tiled", "fast"])
@pytest.mark.parametrize("window", [None, 5], ids=["nowin", "win5"])
def test_matches_the_engine_attention(deterministic: bool, window: int | None, device) -> None:
    """The engine's PyTorch paths (what PagedKVCache.attend runs without the CPU kernel)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 5
    case = paged_case(SPANS, heads, kv_heads, head_dim, block_size, torch.float32, seed=17)
    cache = PagedKVCache(1, case.k.shape[0], block_size, kv_heads, head_dim, torch.float32, use_kernel=False)
    cache.k[0].copy_(case.k)
    cache.v[0].copy_(case.v)
    meta = cache.prepare(case.batch, num_heads=heads, sliding_window=window, deterministic=deterministic)
    assert meta.path == ("tiled" if deterministic else "fast")
    engine = cache.attend(0, case.q, *case.new_kv(), meta, case.scale)
    # q as the engine hands it over: a strided view of the fused qkv rows.
    torch.testing.assert_close(run(case, device, window, strided=True), engine, rtol=1e-5, atol=2e-5)


def test_bad_arguments_name_the_field(device) -> None:
    case = paged_case([(0, 4)], 2, 1, head_dim=16, block_size=4, dtype=torch.float32, seed=0)
    b = case.batch
    q, k, v = case.q.to(device), case.k.to(device), case.v.to(device)
    tables, qsl, lens = b.block_tables.to(device), b.query_start_loc.to(device), b.seq_lens.to(device)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        prefill_attention(q, k, v, tables.long(), qsl, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        prefill_attention(q, k, v, tables, qsl.long(), lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_attention(q, k, v, tables, qsl, lens[:0], 1.0)
    with pytest.raises(ValueError, match="k_cache: head_dim"):
        prefill_attention(q, k[..., :8], v[..., :8], tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="v_cache must be float32"):
        prefill_attention(q, k, v.bfloat16(), tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of k_cache's 2 KV heads"):
        q3 = torch.cat([q, q[:, :1]], dim=1)
        prefill_attention(q3, k.repeat(1, 1, 2, 1), v.repeat(1, 1, 2, 1), tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_attention(q, k, v, tables, qsl, lens, 1.0, sliding_window=-1)
    for cap in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="logit_softcap must be None, 0 \\(no cap\\) or positive"):
            prefill_attention(q, k, v, tables, qsl, lens, 1.0, logit_softcap=cap)
