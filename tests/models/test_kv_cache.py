"""The KV-cache interface: paged vs contiguous, mixed prefill/decode batches, masks, sizing."""

from __future__ import annotations

import pytest
import torch
from decoder_test_helpers import (
    Driver,
    all_at_once,
    chunked,
    contiguous_cache,
    each_alone,
    paged_cache,
    random_mix,
    token_by_token,
)
from forward_batches import forward_batch, scheduled

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.attention import visible_mask
from protoserve.engine.models.kv_cache import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

LENS = (3, 17, 40, 9)


@pytest.fixture(scope="module")
def mistral(tiny_checkpoint):
    return load_model(tiny_checkpoint("mistral")[0], progress=False).model


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENS]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_paged_matches_contiguous(mistral, seqs, deterministic: bool) -> None:
    mistral.set_deterministic(deterministic)
    try:
        ref = Driver(mistral, contiguous_cache(mistral)).run(seqs, each_alone)
        for schedule in (all_at_once, chunked(5), random_mix(3)):
            for block_size in (1, 4, 16):
                paged = Driver(mistral, paged_cache(mistral, num_blocks=200, block_size=block_size)).run(
                    seqs, schedule
                )
                for a, b in zip(paged, ref, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    finally:
        mistral.set_deterministic(True)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_mixed_prefill_and_decode_batches_match_separate_runs(mistral, seqs, deterministic: bool) -> None:
    """Steps that mix prefill chunks of some sequences with single decode tokens of others."""
    mistral.set_deterministic(deterministic)
    try:
        alone = Driver(mistral, paged_cache(mistral)).run(seqs, each_alone)
        for seed in (0, 1):
            mixed = Driver(mistral, paged_cache(mistral)).run(seqs, random_mix(seed))
            for a, b in zip(mixed, alone, strict=True):
                if deterministic:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    finally:
        mistral.set_deterministic(True)


def test_contiguous_cache_token_by_token_matches_prefill(mistral, seqs) -> None:
    ref = Driver(mistral, contiguous_cache(mistral)).run(seqs, all_at_once)
    out = Driver(mistral, contiguous_cache(mistral)).run(seqs, token_by_token)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_stale_blocks_do_not_leak(mistral, seqs) -> None:
    """Blocks reused from an earlier sequence (stale K/V beyond the new one's length) change nothing."""
    cache = paged_cache(mistral, num_blocks=64, block_size=4)
    driver = Driver(mistral, cache)
    fresh = Driver(mistral, paged_cache(mistral, num_blocks=64, block_size=4)).run(seqs[:1], all_at_once)[0]
    driver.run([seqs[2]], all_at_once)  # fills blocks 0.. with another sequence's K/V
    reused = driver.run(seqs[:1], all_at_once)[0]
    assert torch.equal(reused, fresh)


def test_written_slots_hold_the_new_keys(mistral) -> None:
    c = mistral.config
    cache = PagedKVCache(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim)
    batch = forward_batch([scheduled([1, 2, 3, 4, 5, 6], 0, [5, 2])], 4)
    mistral(batch, cache)
    written = cache.k[0].view(-1, c.num_kv_heads, c.head_dim)
    touched = written.abs().sum(dim=(1, 2)) > 0
    # positions 0-3 -> block 5 (slots 20-23), positions 4-5 -> block 2 (slots 8-9)
    assert touched.nonzero().flatten().tolist() == [8, 9, 20, 21, 22, 23]


def test_sliding_window_convention() -> None:
    """HF: query at p sees key j iff p - window < j <= p (window counts the query itself)."""
    mask = visible_mask(torch.arange(6), torch.arange(6), sliding_window=3)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_sliding_window_matches_transformers_mask() -> None:
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = and_masks(causal_mask_function, sliding_window_overlay(5))
    ours = visible_mask(torch.arange(12), torch.arange(12), sliding_window=5)
    for q in range(12):
        for k in range(12):
            assert bool(fn(0, 0, torch.tensor(q), torch.tensor(k))) == bool(ours[q, k]), (q, k)


def test_budget_sizing() -> None:
    per_block = PagedKVCache.block_bytes(30, 16, 3, 64, torch.float32)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4
    cache = PagedKVCache.from_budget(30, 3, 64, budget_bytes=10 * per_block + 5, block_size=16)
    assert cache.num_blocks == 10 and cache.nbytes == 10 * per_block
    assert cache.k[0].shape == (10, 16, 3, 64) and len(cache.v) == 30
    bf16 = PagedKVCache(2, 4, 16, 3, 64, torch.bfloat16)
    assert (
        bf16.k[1].dtype == torch.bfloat16
        and bf16.nbytes == PagedKVCache.block_bytes(2, 16, 3, 64, torch.bfloat16) * 4
    )
