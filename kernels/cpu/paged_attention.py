"""Batch-invariant causal attention over the paged KV cache: ``kernels/cpu/paged_attention.cpp``.

The engine's attention reads K/V straight from the block-paged cache. The C++
kernel does it in one pass per (query token, KV head) with AVX-512 or AVX2, walking
exactly the query's own visible keys in ascending order in 16-key blocks
aligned to position 0, with an online softmax. Because nothing in that walk
depends on the other queries of the batch, one kernel is both the fast path and
the deterministic one: a token's output is bit-identical alone, in any batch,
in a prompt chunk of any size and on any thread count.

``paged_attention_reference`` is the same contract in plain PyTorch (float64,
one query at a time) for the tests.
"""

from __future__ import annotations

import types

import torch

from kernels.cpu.extension import load


def _extension() -> types.ModuleType | None:
    return load("paged_attention")


def available() -> bool:
    """True when the compiled kernel can run here (AVX-512 or AVX2, a compiler, not disabled)."""
    return _extension() is not None


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

    ``k_cache``/``v_cache``: [num_blocks, block_size, KVH, D] float32 or bfloat16,
    already holding this step's new K/V. Sequence b owns query rows
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


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The kernel's contract written out plainly: one query at a time, in float64, -> float32."""
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
            scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.float()
