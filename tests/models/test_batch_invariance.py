"""Deterministic mode: a row's result is bit-identical whatever batch, position or chunking it runs in.

Kernel level: tiled_linear (float32 and bfloat16) and the packed int8/int4
kernels, a row alone vs inside batches of random sizes at random positions.
Model level: every position's logits for one-sequence-alone, all-in-one-batch,
chunked prefill (7, 16, 256), token-by-token decode and random mixes of
prefill chunks and decode tokens are equal with torch.equal; 32 sequences
decoded greedily together give the same tokens and logits as each alone.
The cost of the mode is the bench's figure (compare.det_vs_fast), not measured here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decoder_test_helpers import (
    Driver,
    all_at_once,
    chunked,
    each_alone,
    greedy_generate,
    paged_cache,
    prefill_then_decode_batched,
    random_mix,
    token_by_token,
)

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.linear import ROW_TILE, Int4Linear, Int8Linear, Linear, tiled_linear

SHAPES = [(64, 256), (576, 1536), (1536, 576), (576, 8192)]  # (in, out): tiny, SmolLM2 MLP, down, a wide head


def _rows_alone_vs_batched(fn, x: torch.Tensor, seed: int = 0) -> bool:
    """fn on each row alone vs on random contiguous batches (random sizes, random offsets)."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    g = torch.Generator().manual_seed(seed)
    for _ in range(12):
        m = int(torch.randint(1, x.shape[0] + 1, (1,), generator=g))
        off = int(torch.randint(0, x.shape[0] - m + 1, (1,), generator=g))
        if not torch.equal(fn(x[off : off + m]), alone[off : off + m]):
            return False
    perm = torch.randperm(x.shape[0], generator=g)
    return torch.equal(fn(x[perm]), alone[perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_tiled_linear_rows_are_batch_invariant(shape, dtype) -> None:
    k, n = shape
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(3 * ROW_TILE + 5, k, generator=g).to(dtype)
    assert _rows_alone_vs_batched(lambda a: tiled_linear(a, w, None), x)
    assert _rows_alone_vs_batched(lambda a: tiled_linear(a, w, b), x, seed=1)
    torch.testing.assert_close(tiled_linear(x, w, b), F.linear(x, w, b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_quantized_kernels_are_batch_invariant(mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    lin = Linear(576, 1536, bias=True)
    lin.weight.data.normal_(generator=g)
    lin.bias.data.normal_(generator=g)
    q = Int8Linear.from_linear(lin) if mode == "int8" else Int4Linear.from_linear(lin, 64)
    x = torch.randn(45, 576, generator=g)
    assert _rows_alone_vs_batched(q, x)


# -- whole model ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def tiny_model(request, tiny_checkpoint):
    return load_model(tiny_checkpoint(request.param)[0], progress=False).model


def _seqs(lens, seed=5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_bit_identical_across_schedules(tiny_checkpoint, dtype: str) -> None:
    for family in ("mistral", "qwen3"):
        model = load_model(tiny_checkpoint(family)[0], dtype=dtype, progress=False).model
        seqs = _seqs((300, 1, 37, 16, 70))
        ref = Driver(model, paged_cache(model, num_blocks=160)).run(seqs, each_alone)
        schedules = {
            "one batch": all_at_once,
            "chunks of 256": chunked(256),
            "chunks of 7": chunked(7),
            "token by token": token_by_token,
            "random mix 0": random_mix(0),
            "random mix 1": random_mix(1),
        }
        for name, schedule in schedules.items():
            out = Driver(model, paged_cache(model, num_blocks=160)).run(seqs, schedule)
            for i, (a, b) in enumerate(zip(out, ref, strict=True)):
                assert torch.equal(a, b), f"{family} {dtype}: sequence {i} differs under '{name}'"


def test_logits_bit_identical_with_default_threads(tiny_checkpoint) -> None:
    """The same property with the intra-op thread count the engine runs with (short, it is slow here)."""
    model = load_model(tiny_checkpoint("mistral")[0], progress=False).model
    seqs = _seqs((40, 1, 17))
    ref = Driver(model, paged_cache(model, num_blocks=40)).run(seqs, each_alone)
    for schedule in (chunked(16), random_mix(2)):
        out = Driver(model, paged_cache(model, num_blocks=40)).run(seqs, schedule)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


@pytest.mark.usefixtures("one_thread")
def test_the_schedule_comparison_catches_a_batch_dependent_layer(tiny_checkpoint) -> None:
    """The comparisons above can fail: logits that move with the forward's row count (by parts per
    million, as a GEMM's reduction order can) make token-by-token differ from each-alone. (The model as a
    whole: its fused C++ step runs the layers without calling their modules.)"""
    model = load_model(tiny_checkpoint("qwen3")[0], progress=False).model
    model.register_forward_hook(lambda _module, _args, logits: logits * (1 + 1e-6 * logits.shape[0]))
    seqs = _seqs((300, 37, 70))
    ref = Driver(model, paged_cache(model, num_blocks=160)).run(seqs, each_alone)
    out = Driver(model, paged_cache(model, num_blocks=160)).run(seqs, token_by_token)
    assert not any(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)


@pytest.mark.usefixtures("one_thread")
def test_32_sequences_batched_equal_each_alone(tiny_model) -> None:
    """The engine's requirement: greedy tokens (and logits) of 32 batched requests equal each run alone."""
    g = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (32,), generator=g)
    ]
    batched = greedy_generate(tiny_model, prompts, max_tokens=12)
    alone = [greedy_generate(tiny_model, [p], max_tokens=12)[0] for p in prompts]
    assert batched == alone
    # Same logits too: all prompts prefilled together then decoded together, vs each alone.
    seqs = [p + t for p, t in zip(prompts, batched, strict=True)]
    lens = [len(p) for p in prompts]
    together = Driver(tiny_model, paged_cache(tiny_model, num_blocks=600)).run(
        seqs, prefill_then_decode_batched(lens)
    )
    each = Driver(tiny_model, paged_cache(tiny_model, num_blocks=600)).run(seqs, each_alone)
    assert all(torch.equal(a, b) for a, b in zip(together, each, strict=True))
