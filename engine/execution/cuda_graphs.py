"""Decode steps replayed from CUDA graphs, one per bucketed batch size.

A decode step launches a few hundred small kernels (each layer's norms, projections, RoPE, cache
write and attention), so on a GPU its time is the host launching them rather than the device running
them. Capturing the step once per batch-size bucket and replaying it launches the whole step at once,
as vLLM does. Only plain decode steps qualify (one new token per sequence, no LoRA, no drafts, each
row sampling); anything else runs eagerly.

The graph reads fixed device buffers, so a step of B sequences fills the first B rows of its bucket's
buffers and pads the rest with rows that attend one cached token in a scratch block the block manager
never hands out (the KV pool holds one block more than the engine's budget), and writes their K/V
there. Every kernel computes each row on its own (batch invariant), so a row's logits are the ones the
eager step gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.models.kv_cache import PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the buffers the graph reads
    logits: torch.Tensor  # [bucket, vocab], what it writes


class DecodeGraphs:
    """Lazily captured decode graphs for batches of up to ``max_batch`` sequences."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, max_batch: int, max_blocks: int,
                 scratch_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        self.max_blocks = max_blocks  # block-table width every graph is captured with
        self.scratch_block = scratch_block
        self.device = kv_cache.k[0].device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}

    def accepts(self, batch: ForwardBatch) -> bool:
        """A plain decode step these graphs can replay."""
        n = len(batch.query_lens_list)
        return (n <= self.buckets[-1] and batch.lora_slots is None and all(q == 1 for q in batch.query_lens_list)
                and batch.num_tokens == n and batch.logits_indices.shape[0] == n
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [B, vocab] (on the device), from the graph of B's bucket."""
        n = len(batch.query_lens_list)
        bucket = next(b for b in self.buckets if b >= n)
        captured = self.graphs.get(bucket)
        if captured is None:
            captured = self.graphs[bucket] = self._capture(bucket)
        self._fill(captured.batch, batch)
        captured.graph.replay()
        return captured.logits[:n]

    def _padded(self, bucket: int, batch: ForwardBatch | None) -> ForwardBatch:
        """Host tensors of a bucket-sized step: ``batch``'s rows first, padding rows after."""
        bs = self.kv_cache.block_size
        n = 0 if batch is None else len(batch.query_lens_list)
        input_ids = torch.zeros(bucket, dtype=torch.int64)
        positions = torch.zeros(bucket, dtype=torch.int64)
        seq_lens = torch.ones(bucket, dtype=torch.int32)
        tables = torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.int32)
        slots = torch.full((bucket,), self.scratch_block * bs, dtype=torch.int64)
        if batch is not None:
            if batch.input_ids.device.type == "cpu":  # else still on the device: _fill copies it there
                input_ids[:n] = batch.input_ids
            positions[:n] = batch.positions
            seq_lens[:n] = batch.seq_lens
            tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
            slots[:n] = batch.slot_mapping
        return ForwardBatch(
            input_ids=input_ids, positions=positions,
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32), seq_lens=seq_lens,
            block_tables=tables, slot_mapping=slots, logits_indices=torch.arange(bucket, dtype=torch.int64),
            query_lens_list=[1] * bucket, seq_lens_list=[1] * bucket,
        )  # fmt: skip

    def _fill(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        host = self._padded(static.num_tokens, batch)
        for name in ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping"):
            getattr(static, name).copy_(getattr(host, name), non_blocking=True)
        if batch.input_ids.device.type != "cpu":  # async scheduling: last step's samples, device to device
            static.input_ids[: batch.num_tokens].copy_(batch.input_ids, non_blocking=True)

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _Captured:
        static = self._padded(bucket, None).to(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile the kernels and settle the allocator outside the capture
            for _ in range(2):
                self.model(static, self.kv_cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(static, self.kv_cache)
        return _Captured(graph, static, logits)
