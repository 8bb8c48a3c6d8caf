"""Causal attention of a flattened batch over a slot-addressed KV cache, on CPU in PyTorch.

The engine's paged cache attends with the C++ kernel ``kernels/cpu/paged_attention.cpp``
whenever the CPU can run it (it is both fast and batch invariant, so it serves both
modes). These PyTorch paths are its fallback on other machines (or with
``PROTOSERVE_CPU_KERNELS=0``), and ``sdpa_attention`` is also the reference
``ContiguousKVCache`` uses. Two algorithms over the same inputs:

* ``sdpa_attention`` / ``decode_attention`` (fast): gather context K/V into
  contiguous tensors and call ``F.scaled_dot_product_attention``, per sequence
  for prefill chunks and in one padded call for all single-token decodes. Fast,
  but the kernel's blocking depends on the query count and the padding, so a
  token's output changes in the last bits with the batch and the chunking.

* ``tiled_attention`` (deterministic): the batch is cut into *query tiles* of
  ``QUERY_TILE`` tokens of one sequence (zero-padded) and the context into *key
  blocks* of ``KEY_BLOCK`` positions aligned at position 0. Every (tile, key
  block) pair is one fixed-shape matmul; a tile's softmax takes the exact max
  over its pairs, then sums each pair's ``exp`` row-sums and ``P @ V`` partials
  in ascending key-block order. Fixed-shape matmuls are row-position and
  batch-count invariant, max is exact, and a key block that is fully masked for
  a query adds exact zeros, so a query's output does not depend on which other
  queries share its tile, on the batch, or on how its prompt was chunked.

Both handle grouped-query attention and an optional sliding window with the
Hugging Face convention: query at position p sees key j iff p - window < j <= p.
Scores soft-capped as Gemma 2's (``cap * tanh(scores / cap)``, before the mask) are
taken by ``tiled_attention`` and ``sdpa_attention`` only: SDPA has no such step, so
a soft-capped model attends on the tiled path in both modes.
Scores, softmax and accumulation run in float32 whatever the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protoserve.engine.execution.forward_batch import ForwardBatch

# Tile shapes of deterministic mode. Any fixed values are invariant; these were the fastest
# measured on SmolLM2 over decode batches (T=1, 32) and a 256-token prefill: a decode token
# fills one of a tile's QUERY_TILE slots, so larger tiles waste decode work, smaller ones
# multiply the K/V gathered for prefill.
QUERY_TILE = 4  # query tokens per tile
KEY_BLOCK = 64  # key positions per block
# Bound on the float32 score elements one deterministic chunk materializes (~128 MiB);
# tiles are independent, so splitting the batch into chunks of tiles changes no result.
MAX_SCORE_ELEMENTS = 32 * 1024 * 1024


@dataclass
class TilePlan:
    """Index tensors for ``tiled_attention``, built once per forward and shared by all layers."""

    tile_rows: torch.Tensor  # [n_tiles, QUERY_TILE] int64 row of T for each tile slot (padding: 0)
    tile_valid: torch.Tensor  # [n_tiles, QUERY_TILE] bool, False for padding slots
    pair_tile: torch.Tensor  # [P] int64 tile of each (tile, key block) pair, ascending blocks per tile
    pair_slots: torch.Tensor  # [P, KEY_BLOCK] int64 cache slot of each key position of the pair
    pair_visible: torch.Tensor  # [P, QUERY_TILE, KEY_BLOCK] bool: query slot sees key
    chunks: list[tuple[int, int, int, int]]  # (tile_start, tile_end, pair_start, pair_end)


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., Q, K] bool: causal (k <= q) and, with a window W, q - W < k."""
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def context_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position of one sequence: ``block_table[pos // bs] * bs + pos % bs``."""
    return block_table[positions // block_size].long() * block_size + positions % block_size


def build_tile_plan(
    batch: ForwardBatch, block_size: int, sliding_window: int | None, num_heads_per_kv: int, num_kv_heads: int
) -> TilePlan:
    """Cut the batch into query tiles and list each tile's key blocks, in ascending order."""
    starts = batch.query_start_loc.tolist()
    tile_row0: list[int] = []  # first row of T in the tile
    tile_pos0: list[int] = []  # position of that row in its sequence
    tile_len: list[int] = []  # real (unpadded) queries in the tile
    pair_tile: list[int] = []
    pair_seq: list[int] = []
    pair_block: list[int] = []
    tile_pairs: list[int] = []
    for i, n_new in enumerate(batch.query_lens_list):
        first = batch.seq_lens_list[i] - n_new
        for t0 in range(0, n_new, QUERY_TILE):
            n = min(QUERY_TILE, n_new - t0)
            lo, hi = first + t0, first + t0 + n - 1  # the tile's query positions
            # Every key block holding a key visible to one of the tile's queries.
            first_key = 0 if sliding_window is None else max(0, lo - sliding_window + 1)
            blocks = range(first_key // KEY_BLOCK, hi // KEY_BLOCK + 1)
            pair_tile.extend([len(tile_len)] * len(blocks))
            pair_seq.extend([i] * len(blocks))
            pair_block.extend(blocks)
            tile_pairs.append(len(blocks))
            tile_row0.append(starts[i] + t0)
            tile_pos0.append(lo)
            tile_len.append(n)
    n_tiles = len(tile_len)
    slot = torch.arange(QUERY_TILE)
    valid = slot < torch.tensor(tile_len, dtype=torch.long).reshape(-1, 1)
    rows_t = torch.where(valid, torch.tensor(tile_row0, dtype=torch.long).reshape(-1, 1) + slot, 0)
    pos_t = torch.where(valid, torch.tensor(tile_pos0, dtype=torch.long).reshape(-1, 1) + slot, -1)

    pair_tile_t = torch.tensor(pair_tile, dtype=torch.long)
    key_pos = torch.tensor(pair_block, dtype=torch.long).reshape(-1, 1) * KEY_BLOCK + torch.arange(KEY_BLOCK)
    tables = batch.block_tables.long()
    table_idx = (key_pos // block_size).clamp(max=tables.shape[1] - 1)  # beyond the table: masked anyway
    seq_idx = torch.tensor(pair_seq, dtype=torch.long).reshape(-1, 1)
    pair_slots = tables[seq_idx, table_idx] * block_size + key_pos % block_size
    # Padding slots have position -1 and so see no key.
    pair_visible = visible_mask(pos_t[pair_tile_t], key_pos, sliding_window)

    # Chunks of whole tiles whose scores fit the budget.
    per_pair = num_kv_heads * num_heads_per_kv * QUERY_TILE * KEY_BLOCK
    chunks: list[tuple[int, int, int, int]] = []
    t_start, p_start, p_count = 0, 0, 0
    for t, n_pairs in enumerate(tile_pairs):
        if p_count and (p_count + n_pairs) * per_pair > MAX_SCORE_ELEMENTS:
            chunks.append((t_start, t, p_start, p_start + p_count))
            t_start, p_start, p_count = t, p_start + p_count, 0
        p_count += n_pairs
    if n_tiles:
        chunks.append((t_start, n_tiles, p_start, p_start + p_count))
    return TilePlan(rows_t, valid, pair_tile_t, pair_slots, pair_visible, chunks)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` (Gemma 2's attention-logit soft-capping); the scores as they are when None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def tiled_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: TilePlan, scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Batch-invariant attention. q [T, H, D]; k/v_slots [num_slots, KVH, D] (the cache, flattened)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_slots.shape[1]
    rep = num_heads // num_kv
    rows_per_tile = QUERY_TILE * rep
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32)
    for t0, t1, p0, p1 in plan.chunks:
        n_tiles = t1 - t0
        pair_tile = plan.pair_tile[p0:p1] - t0
        # Query tiles [n_tiles, KVH, QUERY_TILE * rep, D]: one matmul row per (token, head of the group).
        qt = q[plan.tile_rows[t0:t1]].float() * scale
        qt = qt.view(n_tiles, QUERY_TILE, num_kv, rep, head_dim).transpose(1, 2)
        qt = qt.reshape(n_tiles, num_kv, rows_per_tile, head_dim)
        slots = plan.pair_slots[p0:p1]
        kb = k_slots[slots].float().transpose(1, 2)  # [P, KVH, KEY_BLOCK, D]
        vb = v_slots[slots].float().transpose(1, 2)
        scores = soft_cap(torch.matmul(qt[pair_tile], kb.transpose(-1, -2)), logit_softcap)  # [P, KVH, rows, KEY_BLOCK]
        hidden = ~plan.pair_visible[p0:p1]  # [P, QUERY_TILE, KEY_BLOCK]
        hidden = hidden[:, None, :, None, :].expand(-1, 1, QUERY_TILE, rep, KEY_BLOCK)
        scores.masked_fill_(hidden.reshape(-1, 1, rows_per_tile, KEY_BLOCK), float("-inf"))
        # Exact row max over all of the tile's pairs (max does not round).
        block_max = scores.amax(dim=-1)  # [P, KVH, rows]
        row_max = torch.full((n_tiles, num_kv, rows_per_tile), float("-inf")).scatter_reduce_(
            0, pair_tile[:, None, None].expand_as(block_max), block_max, "amax"
        )
        row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # padding rows see nothing
        probs = torch.exp(scores - row_max[pair_tile].unsqueeze(-1))
        # index_add_ accumulates the pairs of a tile sequentially in pair order (ascending key blocks).
        denom = torch.zeros(n_tiles, num_kv, rows_per_tile).index_add_(0, pair_tile, probs.sum(dim=-1))
        acc = torch.zeros(n_tiles, num_kv, rows_per_tile, head_dim).index_add_(
            0, pair_tile, torch.matmul(probs, vb)
        )
        tile_out = acc / denom.clamp(min=1e-30).unsqueeze(-1)
        tile_out = tile_out.view(n_tiles, num_kv, QUERY_TILE, rep, head_dim).transpose(1, 2)
        tile_out = tile_out.reshape(n_tiles, QUERY_TILE, num_heads, head_dim)
        valid = plan.tile_valid[t0:t1]
        out[plan.tile_rows[t0:t1][valid]] = tile_out[valid]
    return out.to(q.dtype)


@dataclass
class DecodePlan:
    """Sequences with one new token each, attended together in one padded SDPA call (fast mode)."""

    seqs: list[int]  # batch indices of the sequences
    rows: torch.Tensor  # [B] int64 row of T of each one's query
    slots: torch.Tensor  # [B, L] int64 cache slots of each context, padded to the longest (slot 0)
    visible: torch.Tensor  # [B, 1, 1, L] bool: key visible to the query (False on padding)


def build_decode_plan(
    batch: ForwardBatch, seqs: list[int], block_size: int, sliding_window: int | None
) -> DecodePlan:
    seq_lens = torch.tensor([batch.seq_lens_list[i] for i in seqs], dtype=torch.long)
    key_pos = torch.arange(int(seq_lens.max()))
    tables = batch.block_tables[seqs].long()
    table_idx = (key_pos // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, table_idx] * block_size + key_pos % block_size
    q_pos = seq_lens - 1
    visible = visible_mask(q_pos.reshape(-1, 1), key_pos, sliding_window)  # [B, 1, L]
    rows = batch.query_start_loc[seqs].long()
    return DecodePlan(seqs, rows, slots, visible.unsqueeze(1))


def decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one query per sequence) over the plan's contexts -> [B, H, D]."""
    qh = q.float().unsqueeze(2)  # [B, H, 1, D]
    kh = k_slots[plan.slots].float().transpose(1, 2)  # [B, KVH, L, D]
    vh = v_slots[plan.slots].float().transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=plan.visible, scale=scale, enable_gqa=True)
    return out.squeeze(2).to(q.dtype)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One sequence: q [n, H, D] at ``q_positions`` over its contiguous context k/v [L, KVH, D] -> [n, H, D]."""
    n = q.shape[0]
    context = k.shape[0]
    qh = q.float().transpose(0, 1)  # [H, n, D]
    kh = k.float().transpose(0, 1)
    vh = v.float().transpose(0, 1)
    if logit_softcap is not None:  # SDPA cannot cap the scores: the softmax written out
        kh = kh.repeat_interleave(qh.shape[0] // kh.shape[0], dim=0)
        vh = vh.repeat_interleave(qh.shape[0] // vh.shape[0], dim=0)
        scores = soft_cap(torch.matmul(qh, kh.transpose(-1, -2)) * scale, logit_softcap)
        mask = visible_mask(q_positions, torch.arange(context), sliding_window)
        out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vh
    elif n == context and sliding_window is None:  # a whole prompt: plain causal
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=scale, enable_gqa=True)
    else:
        mask = visible_mask(q_positions, torch.arange(context), sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)
