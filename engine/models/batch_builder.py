"""Build a ForwardBatch from per-sequence chunks (for tests, tools and simple drivers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch


@dataclass
class SequenceChunk:
    """The new tokens of one sequence in one step.

    ``num_cached`` tokens of the sequence are already in the cache, so the new
    tokens take positions ``num_cached ..``; ``block_table`` must cover them.
    """

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]
    all_logits: bool = False  # logits for every new token, not only the last


def build_forward_batch(chunks: Sequence[SequenceChunk], block_size: int) -> ForwardBatch:
    """Flatten chunks in order into the engine's batch layout (see ForwardBatch)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError("a sequence chunk needs at least one new token")
        end = chunk.num_cached + n
        if -(-end // block_size) > len(chunk.block_table):
            raise ValueError(f"block table of {len(chunk.block_table)} blocks cannot hold {end} tokens")
        start_row = len(input_ids)
        input_ids.extend(int(t) for t in chunk.token_ids)
        for pos in range(chunk.num_cached, end):
            positions.append(pos)
            slots.append(int(chunk.block_table[pos // block_size]) * block_size + pos % block_size)
        logits_rows.extend(range(start_row, start_row + n) if chunk.all_logits else [start_row + n - 1])
        query_lens.append(n)
        seq_lens.append(end)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for i, chunk in enumerate(chunks):
        tables[i, : len(chunk.block_table)] = torch.tensor(list(chunk.block_table), dtype=torch.int32)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
