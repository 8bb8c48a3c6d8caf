"""Decode attention over the paged KV cache: one new query row per sequence.

The special case of ``prefill_attention`` where every sequence brings one token (q ``[B, H, D]``,
the query of sequence b at position ``seq_lens[b] - 1``), with the same cache layout and
semantics as the CPU kernel (``kernels/cpu/paged_attention.py``): ``[num_blocks, block_size,
KVH, D]`` float32 or bfloat16 pools, int32 block tables (key j of sequence b at slot
``block_tables[b][j // block_size] * block_size + j % block_size``), GQA (query head h reads KV
head ``h // (H // KVH)``) and an optional sliding window (key j visible iff ``j > p - W``).

One program per (sequence, KV head) serves the whole group of query heads that share the KV
head, so each cached K/V row is read once per group rather than once per query head: the
group's heads are the rows of one ``tl.dot`` (padded to 16, the GPU minimum). Keys are walked in
tiles of ``BLOCK_N`` aligned to position 0 with an online softmax in float32; float32 pools
multiply in IEEE float32, bfloat16 pools with the query and P rounded to bfloat16 as
``prefill_attention`` does. One program walks the whole context (no split over the keys). Scores
are soft-capped as ``prefill_attention``'s when a cap is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from protoserve.kernels.triton._common import (
    interpreted,
    key_tile,
    load_kv_tile,
    next_pow2,
    online_softmax_step,
    round_to_bf16,
)
from protoserve.kernels.triton.prefill_attention import (
    check_paged_operands,
    check_window_and_cap,
    reference_prefill_attention,
)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_len_ptr,
    scale, window, softcap, block_size, group, head_dim,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh,
    stride_table,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BF16: tl.constexpr, BF16_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_len_ptr + seq)
    pos = seq_len - 1

    heads = kv_head * group + tl.arange(0, BLOCK_G)
    head_ok = tl.arange(0, BLOCK_G) < group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_mask = head_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale
    if BF16:
        q = round_to_bf16(q)

    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)  # the first visible key
    lo = (first // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives exp(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, seq_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = (keys >= first) & (keys < seq_len)
        k, v = load_kv_tile(k_ptr, v_ptr, table_ptr + seq * stride_table, keys, key_ok, d, d_ok, kv_head,
                            block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
        m_i, l_i, acc = online_softmax_step(q, k, v, key_ok[None, :], m_i, l_i, acc, softcap, BF16, BF16_DOT,
                                            SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out, mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, q [B, H, D], over the cache -> float32 [B, H, D].

    ``block_tables`` [B, max_blocks] and ``seq_lens`` [B] (each at least 1) are int32 on q's
    device; the pools already hold this step's K/V. ``sliding_window`` None or 0: no window.
    ``logit_softcap`` None or 0: scores uncapped; else ``cap * tanh(scores / cap)`` before the mask.
    """
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    check_paged_operands(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    check_window_and_cap(sliding_window, logit_softcap)
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out
    bf16 = k_cache.dtype == torch.bfloat16
    block_d = next_pow2(head_dim, 16)
    cpu = interpreted(_paged_decode_kernel)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        float(scale), int(sliding_window or 0), float(logit_softcap or 0.0), k_cache.shape[1], group, head_dim,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        BLOCK_G=next_pow2(group, 16), BLOCK_N=key_tile(block_d, cpu), BLOCK_D=block_d,
        BF16=bf16, BF16_DOT=bf16 and not cpu, SOFTCAP=bool(logit_softcap),
    )  # fmt: skip
    return out


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    round_query: bool = False,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The contract in plain PyTorch: the prefill reference with one query per sequence, its last
    position (float64 -> float32 [B, H, D])."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return reference_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                       sliding_window, round_query, logit_softcap)
