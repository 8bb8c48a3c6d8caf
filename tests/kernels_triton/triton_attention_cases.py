"""Paged-attention cases for the Triton tests, batched by the engine's own batch builder.

A case is a set of sequences, each given as (tokens already cached, tokens after the step), at
random non-contiguous blocks of a pool that also holds garbage in the slots no query may read.
The batch comes from ``build_forward_batch`` (via ``tests/forward_batches.py``), the function
every production step goes through, so the kernels see exactly the layout the engine hands them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from forward_batches import forward_batch, scheduled

from protoserve.engine.execution.forward_batch import ForwardBatch


@dataclass
class PagedCase:
    batch: ForwardBatch  # CPU tensors, as the engine builds them
    k: torch.Tensor  # [num_blocks, block_size, KVH, D] pools holding every context token, new ones too
    v: torch.Tensor
    q: torch.Tensor  # [T, H, D] float32
    scale: float

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new K/V rows as the pools hold them (writing them back changes nothing)."""
        kvh, d = self.k.shape[2], self.k.shape[3]
        slots = self.batch.slot_mapping
        return self.k.reshape(-1, kvh, d)[slots], self.v.reshape(-1, kvh, d)[slots]


def paged_case(
    spans: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedCase:
    """``spans``: per sequence (cached tokens, context length after the step)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-total // block_size) for _, total in spans]
    num_blocks = sum(need) + 3  # spare blocks: garbage no query may read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, start = [], 0
    for (cached, total), n in zip(spans, need, strict=True):
        seqs.append(scheduled(list(range(total)), cached, perm[start : start + n]))
        start += n
    batch = forward_batch(seqs, block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=g) * 2
    return PagedCase(batch, k, v, q, head_dim**-0.5)


def bf16_tolerance(v: torch.Tensor) -> float:
    """P rounded to bfloat16 (relative error <= 2^-8 each, the unrounded weights summing to 1)
    moves an output by at most 2^-8 max|v|, whatever order the kernel sums in."""
    return 2**-8 * v.float().abs().max().item()


def strided_rows(q: torch.Tensor) -> torch.Tensor:
    """q's values as a view with padded rows, like q split off a fused qkv output."""
    wide = torch.zeros(q.shape[0], q.shape[1] + 3, q.shape[2], dtype=q.dtype, device=q.device)
    wide[:, : q.shape[1]] = q
    return wide[:, : q.shape[1]]
