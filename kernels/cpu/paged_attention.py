"""Batch-invariant causal attention over the paged KV cache: ``kernels/cpu/paged_attention.cpp``.

The engine's attention reads K/V straight from the block-paged cache. The C++
kernel does it in one pass per (query token, KV head) with AVX-512 or AVX2, walking
exactly the query's own visible keys in ascending order in 64-key blocks
aligned to position 0, with an online softmax started afresh in each partition
of 256 positions and the partitions folded in ascending order (so one long
sequence's decode can spread its partitions over the threads). Because nothing in that walk
depends on the other queries of the batch, one kernel is both the fast path and
the deterministic one: a token's output is bit-identical alone, in any batch,
in a prompt chunk of any size and on any thread count.

On CPUs with AVX512-BF16, bfloat16 pools (head_dim 32, 64 or 128) are
multiplied in bfloat16 with ``vdpbf16ps``, as GPU flash attention runs its two
matmuls: scores against the scaled query rounded to bfloat16, P @ V with each
block's probabilities rounded to bfloat16 (the softmax itself stays float32).
One instruction does twice a float32 FMA's multiply-adds and the cached K/V
need no widening (``multiplies_in_bf16``). int8 pools (``write_int8_rows``: codes and a
float32 scale per token and KV head) are multiplied there in int16 with ``vpdpwssd``:
the codes widen exactly, the scaled query and each block's weights P * (V scale) are
quantized to 15 bits, so the integer sums are exact (``multiplies_int8_in_int16``).

``paged_attention_reference`` is the same contract in plain PyTorch (float64,
one query at a time) for the tests.
"""

from __future__ import annotations

import types

import torch

from protoserve.kernels.cpu.extension import load


def _extension() -> types.ModuleType | None:
    return load("paged_attention")


def available() -> bool:
    """True when the compiled kernel can run here (AVX-512 or AVX2, a compiler, not disabled)."""
    return _extension() is not None


# The head sizes the kernel holds in registers in 16-bit pairs; others take its float32 walk.
_PAIR_HEAD_DIMS = (32, 64, 128)


def multiplies_in_bf16(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel multiplies a pool of ``cache_dtype`` in bfloat16: scores against
    ``bfloat16(q * scale)``, P @ V with P rounded to bfloat16."""
    ext = _extension()
    return (
        ext is not None and ext.attention_multiplies_in_bf16() and cache_dtype == torch.bfloat16
        and head_dim in _PAIR_HEAD_DIMS
    )


def multiplies_int8_in_int16(head_dim: int) -> bool:
    """Whether the kernel multiplies an int8 pool's codes in int16 (``vpdpwssd``): scores against the scaled
    query quantized per (query, head) to int16, P @ V with the block's weights quantized to int16. Otherwise
    it widens the rows to float32 (code * scale) and runs its float32 walk."""
    ext = _extension()
    return ext is not None and ext.attention_int8_in_int16() and head_dim in _PAIR_HEAD_DIMS


def write_int8_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool``'s rows at ``slots`` (int64 [T]) = ``rows`` ([T, KVH, D]) quantized: each (token, head) row
    to int8 codes round(x * 127 / max|x|) and the float32 scale max|x| / 127."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the paged_attention CPU kernel is not available on this machine")
    ext.write_kv_int8_(pool, slots.to(torch.int64), rows.float().contiguous())


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over the cache -> float32 [T, H, D].

    ``k_cache``/``v_cache``: [num_blocks, block_size, KVH, D] float32 or bfloat16, or int8
    [num_blocks, block_size, KVH, D + 4] (``write_int8_rows``), already holding this step's new K/V. Sequence b owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]``; its context is ``seq_lens[b]``
    tokens, the new queries being its last ones; its keys live at
    ``block_tables[b][j // block_size] * block_size + j % block_size``. The query at
    position p sees key j iff j <= p and, with a window W, j > p - W. Query head h
    reads KV head ``h // (H // KVH)``. ``sliding_window`` None or 0: no window.
    """
    ext = _extension()
    if ext is None:
        raise RuntimeError("the paged_attention CPU kernel is not available on this machine")
    # Converting only what needs it: this runs once per layer per step. q may stay a view of
    # the fused qkv output (strided rows); the kernel needs each row's [H, D] dense.
    if q.dtype != torch.float32:
        q = q.float()
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    index = [
        t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
        for t in (block_tables, query_start_loc, seq_lens)
    ]
    return ext.paged_attention(
        q, k_cache, v_cache, index[0], index[1], index[2], float(scale), int(sliding_window or 0)
    )


def shared_tiles(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
) -> tuple[int, int]:
    """(shared tiles, decode queries in them) of the kernel's plan for these indices, as ``paged_attention``
    takes them: decodes whose tables hold the same blocks for a whole partition of 256 keys walk it together."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the paged_attention CPU kernel is not available on this machine")
    index = [t.to(torch.int32).contiguous() for t in (block_tables, query_start_loc, seq_lens)]
    return tuple(ext.attention_shared_tiles(*index, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                                            int(sliding_window or 0)))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    round_query: bool = False,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The kernel's contract written out plainly: one query at a time, in float64, -> float32.

    ``round_query``: score against ``bfloat16(float32(q) * scale)``, as the kernel does where
    ``multiplies_in_bf16`` says so (its rounding of P is not modelled). ``logit_softcap``: scores
    ``cap * tanh(scores / cap)`` before the softmax, the Triton kernels' option (this kernel has none)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_slots = k_cache.reshape(-1, num_kv_heads, head_dim).double()
    v_slots = v_cache.reshape(-1, num_kv_heads, head_dim).double()
    starts = query_start_loc.tolist()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for b, seq_len in enumerate(seq_lens.tolist()):
        n = starts[b + 1] - starts[b]
        table = block_tables[b].long()
        for i in range(n):
            row = starts[b] + i
            pos = seq_len - n + i
            first = max(0, pos - sliding_window + 1) if sliding_window else 0
            keys = torch.arange(first, pos + 1)
            slots = table[keys // block_size] * block_size + keys % block_size
            k = k_slots[slots].repeat_interleave(group, dim=1)  # [L, H, D]: head h reads kv head h // group
            v = v_slots[slots].repeat_interleave(group, dim=1)
            if round_query:
                scaled = (q[row].float() * scale).to(torch.bfloat16).double()
                scores = torch.einsum("hd,lhd->hl", scaled, k)
            else:
                scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            if logit_softcap:
                scores = torch.tanh(scores / logit_softcap) * logit_softcap
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.float()
