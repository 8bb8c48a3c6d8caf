"""kernels/cpu/paged_attention.cpp: correctness against a float64 reference, and batch invariance.

The kernel must match the plain per-query reference for every head size (the
vector path for multiples of 16, the scalar one otherwise), GQA ratios, cache
block sizes, float32 and bfloat16 caches, sliding windows, scattered block
tables and batches mixing prefill chunks with single-token decodes. And since
it serves the engine's deterministic mode, a query's output must be
bit-identical alone, inside any batch, in a prompt chunk of any size and with
1 or 2 threads.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from forward_batches import forward_batch, scheduled

from protoserve.engine.models.kv_cache import PagedKVCache, int8_pool_values, kv_row_elements
from protoserve.kernels.cpu import extension
from protoserve.kernels.cpu import paged_attention as pa

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")


@dataclass
class Cache:
    """A paged K/V cache holding whole sequences at random, non-contiguous blocks."""

    k: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v: torch.Tensor
    tables: list[list[int]]  # block ids of each sequence
    lens: list[int]  # tokens of each sequence in the cache
    block_size: int


def make_cache(
    lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, g: torch.Generator
) -> Cache:
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3  # spare blocks hold garbage no query may read
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    k, v = (int8_pool(x) if dtype == torch.int8 else x.to(dtype) for x in (k, v))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(perm[start : start + n])
        start += n
    return Cache(k, v, tables, list(lens), block_size)


def int8_pool(x: torch.Tensor) -> torch.Tensor:
    """x [num_blocks, block_size, KVH, D] float32 as an int8 pool (the kernel's own quantizer)."""
    nb, bs, kvh, d = x.shape
    pool = torch.zeros(nb, bs, kvh, kv_row_elements(d, torch.int8), dtype=torch.int8)
    pa.write_int8_rows(pool, torch.arange(nb * bs), x.reshape(-1, kvh, d))
    return pool


def values(pool: torch.Tensor) -> torch.Tensor:
    """What a pool holds, in float32."""
    return int8_pool_values(pool) if pool.dtype == torch.int8 else pool.float()


@dataclass
class Step:
    """One call's batch: (sequence, first query position, query count) per entry."""

    entries: list[tuple[int, int, int]]


def step_indices(cache: Cache, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's block tables (padded, like the engine's), query_start_loc and seq_lens, as the kernel takes them."""
    width = max(len(cache.tables[s]) for s, _, _ in step.entries) + 2
    tables = torch.zeros(len(step.entries), width, dtype=torch.int32)
    for i, (s, _, _) in enumerate(step.entries):
        tables[i, : len(cache.tables[s])] = torch.tensor(cache.tables[s], dtype=torch.int32)
    counts = torch.tensor([n for _, _, n in step.entries], dtype=torch.int32)
    qsl = torch.zeros(len(step.entries) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(counts, 0)
    seq_lens = torch.tensor([p + n for _, p, n in step.entries], dtype=torch.int32)  # context after the step
    return tables, qsl, seq_lens


def run(
    cache: Cache,
    q_all: list[torch.Tensor],
    step: Step,
    scale: float,
    window: int,
    fn=pa.paged_attention,
) -> list[torch.Tensor]:
    """Attend the step's queries (rows of q_all[seq] at their positions); one [n, H, D] per entry."""
    q = torch.cat([q_all[s][p : p + n] for s, p, n in step.entries])
    tables, qsl, seq_lens = step_indices(cache, step)
    out = fn(q, cache.k, cache.v, tables, qsl, seq_lens, scale, window)
    return list(out.split([n for _, _, n in step.entries]))


def test_kernel_loads_on_this_machine() -> None:
    """make install builds it; a supported CPU that cannot load it is a broken install, not a skip."""
    assert pa.available()


CASES = [
    # (head_dim, num_heads, kv_heads, block_size, window)
    (64, 9, 3, 16, 0),  # SmolLM2
    (64, 9, 3, 16, 20),
    (64, 4, 4, 5, 0),  # block size not a divisor of the 64-key blocks
    (16, 4, 2, 1, 0),  # the tiny test models
    (16, 4, 2, 4, 7),
    (32, 6, 2, 32, 0),  # qwen3 tiny
    (128, 8, 1, 16, 33),  # GQA 8
    (80, 3, 3, 16, 0),  # multiple of 16, not a register-held size
    (24, 6, 2, 16, 0),  # scalar path
    (24, 3, 1, 3, 9),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", CASES, ids=[f"D{d}-H{h}-KV{kv}-bs{bs}-w{w}" for d, h, kv, bs, w in CASES])
def test_matches_reference(case: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    head_dim, heads, kv_heads, block_size, window = case
    if dtype == torch.int8 and head_dim % 16:
        pytest.skip("int8 rows need head_dim a multiple of 16 (test_int8_pool_refuses_odd_head_dims)")
    g = torch.Generator().manual_seed(sum(case))
    lens = [70, 1, 33, 16, 17, 5, 48]
    cache = make_cache(lens, kv_heads, head_dim, block_size, dtype, g)
    q_all = [torch.randn(n, heads, head_dim, generator=g) * 2 for n in lens]
    # A mixed step: whole prompts, prompt chunks in the middle, single-token decodes.
    step = Step([(0, 30, 40), (1, 0, 1), (2, 32, 1), (3, 0, 16), (4, 9, 8), (5, 4, 1), (6, 20, 13)])
    scale = head_dim**-0.5
    out = run(cache, q_all, step, scale, window)
    in_bf16 = pa.multiplies_in_bf16(dtype, head_dim)
    in_int16 = dtype == torch.int8 and pa.multiplies_int8_in_int16(head_dim)
    reference = functools.partial(pa.paged_attention_reference, round_query=in_bf16)
    ref = run(Cache(values(cache.k), values(cache.v), cache.tables, cache.lens, block_size), q_all, step, scale,
              window, fn=reference)
    # bf16 products: P rounded to bfloat16 (relative error <= 2^-9 each, the weights summing to 1)
    # moves an output by at most 2^-9 max|v|; int16 products round the query and the weights to 15 bits.
    max_v = values(cache.v).abs().max().item()
    tolerance = 2**-9 * max_v if in_bf16 else 2**-12 * max_v if in_int16 else 1e-5
    for a, b in zip(out, ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=tolerance)
    if dtype == torch.int8 and not in_int16:  # the float32 walk over the rows widened to code * scale
        widened = Cache(values(cache.k), values(cache.v), cache.tables, cache.lens, block_size)
        assert all(torch.equal(a, b) for a, b in zip(out, run(widened, q_all, step, scale, window), strict=True))
    if in_bf16:  # the rounding is real: the unrounded contract is measurably further away
        exact = run(cache, q_all, step, scale, window, fn=pa.paged_attention_reference)
        assert max((a - b).abs().max().item() for a, b in zip(out, exact, strict=True)) > 1e-4


def test_int8_rows_hold_codes_and_a_scale_per_token_and_head() -> None:
    """write_int8_rows: codes round(x * 127 / max|x|) and the scale max|x| / 127 of each (token, KV head)
    row, computed as this float32 reference does; a zero row keeps codes 0 and scale 0."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 2, 64, generator=g) * torch.rand(3, 5, 2, 1, generator=g) * 8
    x[1, 2, 0] = 0.0
    pool = int8_pool(x)
    assert pool.shape == (3, 5, 2, 68) and pool.dtype == torch.int8
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax == 0, 0.0, torch.full_like(amax, 127.0) / amax)  # not 127 / amax: torch rounds 1 / amax first
    assert torch.equal(pool[..., :64], torch.round(x * inv).to(torch.int8))
    assert torch.equal(pool[..., 64:].contiguous().view(torch.float32), amax / 127.0)
    assert torch.equal(values(pool)[1, 2, 0], torch.zeros(64))
    assert (values(pool) - x).abs().max() <= (amax / 254.0).max() * 1.0001  # half a step at most
    slots = torch.tensor([7, 2])
    rows = torch.randn(2, 2, 64, generator=g)
    pa.write_int8_rows(pool, slots, rows)  # scattered slots, the rest untouched
    assert torch.equal(values(pool).view(-1, 2, 64)[slots], values(int8_pool(rows.view(1, 2, 2, 64))).view(2, 2, 64))
    assert torch.equal(pool.view(-1, 2, 68)[0], int8_pool(x).view(-1, 2, 68)[0])


def test_int8_pool_refuses_odd_head_dims() -> None:
    q = torch.randn(3, 2, 24)
    pool = torch.zeros(4, 4, 1, 28, dtype=torch.int8)
    index = (torch.tensor([[0]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
             torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int8 K/V rows need head_dim a multiple of 16"):
        pa.paged_attention(q, pool, pool, *index, 0.25)
    with pytest.raises(ValueError, match="int8 is read only by the CPU attention kernel"):
        PagedKVCache(1, 4, 4, 1, 24, torch.int8)
    with pytest.raises(ValueError, match="int8 is read only by the CPU attention kernel"):
        PagedKVCache(1, 4, 4, 1, 64, torch.int8, use_kernel=False)


def test_int8_pool_multiplies_in_int16_where_the_cpu_has_them() -> None:
    """int8 pools multiply in int16 where bf16 pools multiply in bf16 (AVX512-BF16 CPUs have VNNI)."""
    from protoserve.kernels.cpu.extension import cpu_flags

    flags = cpu_flags().split()
    assert pa.multiplies_int8_in_int16(64) == ("avx512_bf16" in flags and "avx512_vnni" in flags)
    assert not pa.multiplies_int8_in_int16(80)


def test_bf16_products_where_the_cpu_has_them() -> None:
    """AVX512-BF16 CPUs multiply bfloat16 pools with vdpbf16ps (head_dim a multiple of 32 only)."""
    from protoserve.kernels.cpu.extension import cpu_flags

    has_bf16 = "avx512_bf16" in cpu_flags().split()
    assert pa.multiplies_in_bf16(torch.bfloat16, 64) == has_bf16
    assert not pa.multiplies_in_bf16(torch.bfloat16, 48) and not pa.multiplies_in_bf16(torch.float32, 64)


def test_peaked_and_flat_scores() -> None:
    """Large score ranges (probabilities that underflow to 0) and all-equal scores.

    Scores of magnitude ~250 carry float32 rounding of ~250 * 2^-24 each, hence the
    looser tolerance for the peaked case.
    """
    g = torch.Generator().manual_seed(3)
    cache = make_cache([100], 2, 64, 16, torch.float32, g)
    q_all = [torch.randn(100, 4, 64, generator=g) * 30]
    step = Step([(0, 0, 100)])
    out = run(cache, q_all, step, 1.0, 0)[0]
    ref = run(cache, q_all, step, 1.0, 0, fn=pa.paged_attention_reference)[0]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    flat = [torch.zeros(100, 4, 64)]
    out = run(cache, flat, step, 1.0, 0)[0]
    ref = run(cache, flat, step, 1.0, 0, fn=pa.paged_attention_reference)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strided_query_rows() -> None:
    """q as the engine passes it: a view of the fused qkv output, rows further apart than H * D."""
    g = torch.Generator().manual_seed(1)
    cache = make_cache([40], 3, 64, 16, torch.float32, g)
    qkv = torch.randn(40, (9 + 2 * 3) * 64, generator=g)
    q = qkv[:, : 9 * 64].view(40, 9, 64)
    assert not q.is_contiguous()
    args = (cache.k, cache.v, torch.tensor([cache.tables[0]], dtype=torch.int32))
    index = (torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32))
    out = pa.paged_attention(q, *args, *index, 0.125)
    assert torch.equal(out, pa.paged_attention(q.contiguous(), *args, *index, 0.125))


def test_rejects_bad_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    cache = make_cache([20], 2, 16, 4, torch.float32, g)
    q = torch.randn(3, 4, 16)
    tables = torch.tensor([cache.tables[0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    ok = pa.paged_attention(q, cache.k, cache.v, tables, qsl, torch.tensor([20], dtype=torch.int32), 0.25)
    assert ok.shape == (3, 4, 16)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        pa.paged_attention(q, cache.k, cache.v, tables, qsl, torch.tensor([21], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="queries but a context"):
        pa.paged_attention(q, cache.k, cache.v, tables, qsl, torch.tensor([2], dtype=torch.int32), 0.25)
    bad_tables = tables.clone()
    bad_tables[0, 1] = cache.k.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        pa.paged_attention(q, cache.k, cache.v, bad_tables, qsl, torch.tensor([20], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        pa.paged_attention(
            q[:, :3], cache.k, cache.v, tables, qsl, torch.tensor([20], dtype=torch.int32), 0.25
        )


# -- batch invariance ---------------------------------------------------------------------------

INVARIANCE = [
    # (head_dim, num_heads, kv_heads, block_size, window, dtype)
    (64, 9, 3, 16, 0, torch.float32),
    (64, 9, 3, 16, 37, torch.bfloat16),
    (64, 9, 3, 16, 37, torch.int8),
    (16, 4, 2, 4, 0, torch.int8),
    (16, 4, 2, 4, 0, torch.float32),
    (24, 6, 2, 16, 0, torch.float32),
]


@pytest.fixture(params=INVARIANCE, ids=[f"D{c[0]}-bs{c[3]}-w{c[4]}-{str(c[5])[6:]}" for c in INVARIANCE])
def setup(request) -> Iterator[tuple[Cache, list[torch.Tensor], int, float]]:
    head_dim, heads, kv_heads, block_size, window, dtype = request.param
    g = torch.Generator().manual_seed(head_dim + window)
    lens = [150, 37, 64, 1, 90, 23]
    cache = make_cache(lens, kv_heads, head_dim, block_size, dtype, g)
    q_all = [torch.randn(n, heads, head_dim, generator=g) for n in lens]
    yield cache, q_all, window, head_dim**-0.5


def alone(cache: Cache, q_all: list[torch.Tensor], window: int, scale: float) -> list[torch.Tensor]:
    """Every query of every sequence in a call of its own (a decode step)."""
    return [
        torch.cat([run(cache, q_all, Step([(s, p, 1)]), scale, window)[0] for p in range(n)])
        for s, n in enumerate(cache.lens)
    ]


def chunked(
    cache: Cache, q_all: list[torch.Tensor], window: int, scale: float, sizes: list[int]
) -> list[torch.Tensor]:
    """Each sequence's prompt in consecutive chunks (sizes cycled), one sequence per call."""
    outs = []
    for s, n in enumerate(cache.lens):
        parts, p, i = [], 0, 0
        while p < n:
            c = min(sizes[i % len(sizes)], n - p)
            parts.append(run(cache, q_all, Step([(s, p, c)]), scale, window)[0])
            p, i = p + c, i + 1
        outs.append(torch.cat(parts))
    return outs


def random_batches(
    cache: Cache, q_all: list[torch.Tensor], window: int, scale: float, seed: int
) -> list[torch.Tensor]:
    """All sequences advancing together in random chunk sizes, in shuffled order within each call."""
    g = torch.Generator().manual_seed(seed)
    done = [0] * len(cache.lens)
    parts: list[list[torch.Tensor]] = [[] for _ in cache.lens]
    while any(d < n for d, n in zip(done, cache.lens, strict=True)):
        entries = []
        for s, n in enumerate(cache.lens):
            if done[s] < n:
                c = min(n - done[s], int(torch.randint(1, 40, (1,), generator=g)))
                entries.append((s, done[s], c))
                done[s] += c
        order = torch.randperm(len(entries), generator=g).tolist()
        entries = [entries[i] for i in order]
        for (s, _, _), out in zip(entries, run(cache, q_all, Step(entries), scale, window), strict=True):
            parts[s].append(out)
    return [torch.cat(p) for p in parts]


def test_same_bits_alone_chunked_and_batched(setup) -> None:
    cache, q_all, window, scale = setup
    ref = alone(cache, q_all, window, scale)
    schedules = {
        "whole prompts": chunked(cache, q_all, window, scale, [10**6]),
        "chunks of 7": chunked(cache, q_all, window, scale, [7]),
        "chunks of 3, 16, 33": chunked(cache, q_all, window, scale, [3, 16, 33]),
        "random batches 0": random_batches(cache, q_all, window, scale, 0),
        "random batches 1": random_batches(cache, q_all, window, scale, 1),
    }
    for name, outs in schedules.items():
        for s, (a, b) in enumerate(zip(outs, ref, strict=True)):
            assert torch.equal(a, b), f"sequence {s} differs under '{name}'"


def test_same_bits_any_thread_count() -> None:
    """Enough work that the kernel forks (prefill of 300 + decodes), 1 vs 2 threads."""
    g = torch.Generator().manual_seed(5)
    cache = make_cache([300, 200, 120, 64], 3, 64, 16, torch.float32, g)
    q_all = [torch.randn(n, 9, 64, generator=g) for n in cache.lens]
    step = Step([(0, 0, 300), (1, 199, 1), (2, 100, 20), (3, 63, 1)])
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            results.append(torch.cat(run(cache, q_all, step, 0.125, 0)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# -- long contexts: key partitions, split across threads or walked in turn ------------------------

LONG = [  # (dtype, window): partitions of 256 keys; the window crosses their boundaries
    (torch.float32, 0),
    (torch.bfloat16, 0),
    (torch.bfloat16, 300),
    (torch.int8, 300),
]


@pytest.mark.parametrize("dtype,window", LONG, ids=[f"{str(d)[6:]}-w{w}" for d, w in LONG])
def test_long_context_matches_reference(dtype: torch.dtype, window: int) -> None:
    """Queries whose keys span several partitions (a decode at 700, a chunk across 512) against the reference."""
    g = torch.Generator().manual_seed(17 + window)
    cache = make_cache([700, 530, 9], 3, 64, 16, dtype, g)
    q_all = [torch.randn(n, 9, 64, generator=g) for n in cache.lens]
    step = Step([(0, 699, 1), (1, 500, 30), (2, 0, 9)])
    out = run(cache, q_all, step, 0.125, window)
    in_bf16 = pa.multiplies_in_bf16(dtype, 64)
    in_int16 = dtype == torch.int8 and pa.multiplies_int8_in_int16(64)
    reference = functools.partial(pa.paged_attention_reference, round_query=in_bf16)
    max_v = values(cache.v).abs().max().item()
    tolerance = 2**-9 * max_v if in_bf16 else 2**-12 * max_v if in_int16 else 1e-5
    exact = Cache(values(cache.k), values(cache.v), cache.tables, cache.lens, cache.block_size)
    for a, b in zip(out, run(exact, q_all, step, 0.125, window, fn=reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=tolerance)


@pytest.mark.parametrize("dtype,window", LONG, ids=[f"{str(d)[6:]}-w{w}" for d, w in LONG])
def test_long_context_same_bits_split_or_walked(dtype: torch.dtype, window: int) -> None:
    """A lone decode splits its partitions across threads; in a batch of many tiles each tile walks
    them in turn on one thread; in a batch where it holds most of the work it splits again. The
    partitions' fold is the same, so the bits are, on 1 or 2 threads and in any prompt chunking."""
    g = torch.Generator().manual_seed(23 + window)
    lens = [600, *[40] * 12]
    cache = make_cache(lens, 3, 64, 16, dtype, g)
    q_all = [torch.randn(n, 9, 64, generator=g) for n in cache.lens]
    positions = [*range(250, 262), *range(508, 516), 599]
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[f"alone, {threads} threads"] = torch.cat(
                [run(cache, q_all, Step([(0, p, 1)]), 0.125, window)[0] for p in positions]
            )
        shorts = [(s, 0, 40) for s in range(1, len(lens))]  # 60 tiles: whole-tile units
        for name, sizes in {"whole prompt": [600], "chunks of 256": [256], "chunks of 7, 100": [7, 100]}.items():
            parts, p, i = [], 0, 0
            while p < 600:
                c = min(sizes[i % len(sizes)], 600 - p)
                parts.append(run(cache, q_all, Step([(0, p, c), *shorts]), 0.125, window)[0])
                p, i = p + c, i + 1
            results[f"{name}, with short prompts"] = torch.cat(parts)[positions]
        decodes = [(s, 39, 1) for s in range(1, len(lens))]  # few tiles beside the long one's: it splits
        results["among decodes"] = torch.cat(
            [run(cache, q_all, Step([*decodes, (0, p, 1)]), 0.125, window)[-1] for p in positions]
        )
    finally:
        torch.set_num_threads(before)
    first = results.pop("alone, 1 threads")
    for name, out in results.items():
        assert torch.equal(out, first), f"differs {name}"


# -- decodes sharing a cached prefix's blocks ----------------------------------------------------------

SHARED = [(torch.float32, 16), (torch.bfloat16, 16), (torch.int8, 16), (torch.bfloat16, 4)]


def shared_prefix_cache(dtype: torch.dtype, block_size: int) -> tuple[Cache, list[torch.Tensor], list[int]]:
    """35 sequences whose tables start with the same blocks (a 600-token prompt prefix cached once: two
    whole partitions and 88 keys of a third), one sharing only the first partition with them, one sharing
    nothing; and where each decodes (two at a partition's last key: the shared keys are all they see of it)."""
    g = torch.Generator().manual_seed(31 + block_size)
    group = 35  # more than one shared tile's 32 queries
    lens = [640 + 9 * i for i in range(group)] + [520, 300]
    cache = make_cache(lens, 3, 64, block_size, dtype, g)
    prefix = 600 // block_size
    for table in cache.tables[1:group]:
        table[:prefix] = cache.tables[0][:prefix]
    cache.tables[group][: 256 // block_size] = cache.tables[0][: 256 // block_size]
    q_all = [torch.randn(n, 9, 64, generator=g) for n in cache.lens]
    positions = [n - 1 - 5 * (i % 4) for i, n in enumerate(lens)]
    positions[3], positions[4] = 255, 511
    return cache, q_all, positions


@pytest.mark.parametrize("dtype,block_size", SHARED, ids=[f"{str(d)[6:]}-bs{b}" for d, b in SHARED])
def test_decodes_sharing_prefix_blocks_same_bits_as_alone(dtype: torch.dtype, block_size: int) -> None:
    """Decodes whose tables hold the same blocks from a partition's start walk those keys together (shared
    tiles), then each the rest of its partition alone; each query's bits are still those of its own walk,
    on 1 or 2 threads, beside a prompt chunk too."""
    cache, q_all, positions = shared_prefix_cache(dtype, block_size)
    decodes = [(s, p, 1) for s, p in enumerate(positions)]
    step = Step(decodes)
    tables, qsl, seq_lens = step_indices(cache, step)
    # Partition 0: the 35 and the 36th, in tiles of 32 and 4; partition 1: the 34 of the 35 that see all of
    # it (32 and 2); partition 2's first 64 keys (512-575, in the 600 shared): the 33 that see them, 32 in a
    # tile (the 33rd walks alone).
    assert pa.shared_tiles(tables, qsl, seq_lens, 9, 3, 64, cache.k.shape[0], block_size) == (5, 102)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [run(cache, q_all, Step([d]), 0.125, 0)[0] for d in decodes]
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[f"together, {threads} threads"] = run(cache, q_all, step, 0.125, 0)
            chunk = (len(decodes) - 1, 100, 60)  # the unshared sequence's prompt chunk, decodes around it
            results[f"beside a prompt chunk, {threads} threads"] = [
                out for out, entry in zip(run(cache, q_all, Step([*decodes[:-1], chunk]), 0.125, 0),
                                          [*decodes[:-1], chunk], strict=True) if entry[2] == 1
            ]
    finally:
        torch.set_num_threads(before)
    for name, outs in results.items():
        for s, (a, b) in enumerate(zip(outs, alone, strict=False)):
            assert torch.equal(a, b), f"sequence {s} differs {name}"
    in_bf16 = pa.multiplies_in_bf16(dtype, 64)
    in_int16 = dtype == torch.int8 and pa.multiplies_int8_in_int16(64)
    max_v = values(cache.v).abs().max().item()
    tolerance = 2**-9 * max_v if in_bf16 else 2**-12 * max_v if in_int16 else 1e-5
    exact = Cache(values(cache.k), values(cache.v), cache.tables, cache.lens, cache.block_size)
    reference = functools.partial(pa.paged_attention_reference, round_query=in_bf16)
    for a, b in zip(results["together, 2 threads"], run(exact, q_all, step, 0.125, 0, fn=reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=tolerance)


def test_short_decodes_share_the_key_blocks_of_a_prefix_within_one_partition() -> None:
    """Contexts under 256 keys sharing a 150-token prefix: two 64-key blocks walked together, the rest alone."""
    g = torch.Generator().manual_seed(41)
    lens = [160 + 3 * i for i in range(20)]
    cache = make_cache(lens, 3, 64, 16, torch.bfloat16, g)
    for table in cache.tables[1:]:
        table[: 150 // 16] = cache.tables[0][: 150 // 16]
    q_all = [torch.randn(n, 9, 64, generator=g) for n in cache.lens]
    decodes = [(s, n - 1, 1) for s, n in enumerate(lens)]
    assert pa.shared_tiles(*step_indices(cache, Step(decodes)), 9, 3, 64, cache.k.shape[0], 16) == (1, 20)
    together = run(cache, q_all, Step(decodes), 0.125, 0)
    for d, out in zip(decodes, together, strict=True):
        assert torch.equal(out, run(cache, q_all, Step([d]), 0.125, 0)[0]), f"sequence {d[0]} differs"


def test_no_shared_tiles_under_a_window_or_for_blocks_not_dividing_a_key_block() -> None:
    cache, _, positions = shared_prefix_cache(torch.float32, 16)
    tables, qsl, seq_lens = step_indices(cache, Step([(s, p, 1) for s, p in enumerate(positions)]))
    blocks = cache.k.shape[0]
    assert pa.shared_tiles(tables, qsl, seq_lens, 9, 3, 64, blocks, 16)[0] > 0
    assert pa.shared_tiles(tables, qsl, seq_lens, 9, 3, 64, blocks, 16, sliding_window=300) == (0, 0)
    # 24-token blocks: a 64-key block would start inside a cache block.
    wide = tables[:, : max(map(len, cache.tables)) * 16 // 24]
    assert pa.shared_tiles(wide, qsl, seq_lens, 9, 3, 64, blocks, 24) == (0, 0)
    assert pa.shared_tiles(tables, qsl, seq_lens, 9, 3, 24, blocks, 16) == (0, 0)  # head size: the scalar walk


# -- in the engine's cache -------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 11])
def test_paged_cache_kernel_path_matches_pytorch_fallbacks(window: int | None) -> None:
    """PagedKVCache attends with the kernel in both modes; its PyTorch fallbacks agree with it."""
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 4
    caches = {
        "kernel": PagedKVCache(1, 64, bs, kv_heads, head_dim),
        "fallback": PagedKVCache(1, 64, bs, kv_heads, head_dim, use_kernel=False),
    }
    assert caches["kernel"].use_kernel
    # Two steps: prompts (one chunked), then a mix of a chunk and decodes over what is cached.
    steps = [
        [scheduled([0] * 30, 0, range(0, 10)), scheduled([0] * 12, 0, range(10, 20))],
        [
            scheduled([0] * 31, 30, range(0, 10)),
            scheduled([0] * 21, 12, range(10, 20)),
            scheduled([0] * 5, 0, range(20, 22)),
        ],
    ]
    for seqs in steps:
        batch = forward_batch(seqs, bs)
        t = batch.num_tokens
        q = torch.randn(t, heads, head_dim, generator=g)
        k = torch.randn(t, kv_heads, head_dim, generator=g)
        v = torch.randn(t, kv_heads, head_dim, generator=g)
        outs = {}
        for deterministic in (True, False):
            for name, cache in caches.items():
                meta = cache.prepare(
                    batch, num_heads=heads, sliding_window=window, deterministic=deterministic
                )
                expected = "kernel" if name == "kernel" else ("tiled" if deterministic else "fast")
                assert meta.path == expected
                assert meta.tile_plan is None or name == "fallback"  # the kernel builds no plan
                outs[name, deterministic] = cache.attend(0, q, k, v, meta, head_dim**-0.5)
        assert torch.equal(outs["kernel", True], outs["kernel", False])  # one kernel for both modes
        for deterministic in (True, False):
            torch.testing.assert_close(
                outs["kernel", True], outs["fallback", deterministic], rtol=1e-5, atol=1e-5
            )
