"""Causal attention of a ragged batch of new query rows over the paged KV cache (chunked prefill).

The contract is the CPU kernel's (``kernels/cpu/paged_attention.py``), so the GPU backend can
swap one for the other under the same ``KVCache.attend``: q ``[T, H, D]`` holds the new tokens of
B sequences concatenated; sequence b owns rows ``query_start_loc[b]:query_start_loc[b+1]``, its
context after the step is ``seq_lens[b]`` tokens (the new ones last, their K/V already written
into the pools), and key j of it lives at slot ``block_tables[b][j // block_size] * block_size
+ j % block_size`` of the ``[num_blocks, block_size, KVH, D]`` pools. The query at position p
sees key j iff ``j <= p`` and, with a window W, ``j > p - W``. Query head h reads KV head
``h // (H // KVH)``. A batch may mix prefill chunks with single-token decodes.

One program per (sequence, tile of ``BLOCK_M`` query rows, query head) walks the keys its rows
can see in tiles of ``BLOCK_N`` aligned to position 0 (each key's slot looked up in the block
table, so any block size works) with an online softmax in float32. Float32 pools multiply in
IEEE float32 (no TF32); bfloat16 pools multiply as flash attention does: scores against the
scaled query rounded to bfloat16, P @ V with P rounded to bfloat16, the softmax in float32 (what
the CPU kernel does where ``multiplies_in_bf16``). With ``logit_softcap`` the scores become
``cap * tanh(scores / cap)`` before the mask and softmax, as transformers' Gemma 2 computes them (the
CPU kernel has no cap: there a capped model attends on the engine's PyTorch tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from protoserve.kernels.cpu.paged_attention import paged_attention_reference
from protoserve.kernels.triton._common import (
    INDEX_DTYPE,
    check_dim,
    check_tensor,
    check_unit_stride,
    interpreted,
    key_tile,
    load_kv_tile,
    next_pow2,
    online_softmax_step,
    round_to_bf16,
)

POOL_DTYPES = (torch.float32, torch.bfloat16)
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # tl.dot needs at least 16 rows on a GPU


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, start_ptr, seq_len_ptr,
    scale, window, softcap, block_size, group, head_dim,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_table,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BF16: tl.constexpr, BF16_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(start_ptr + seq)
    q_len = tl.load(start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid covers the longest query run; shorter ones stop here
        return
    seq_len = tl.load(seq_len_ptr + seq)
    kv_head = head // group

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    pos = seq_len - q_len + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale
    if BF16:
        q = round_to_bf16(q)

    # Keys [lo, hi): from the first key the tile's first row sees to its last row's position.
    first_pos = seq_len - q_len + tile * BLOCK_M
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)  # each row's first visible key
    lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives exp(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        k, v = load_kv_tile(k_ptr, v_ptr, table_ptr + seq * stride_table, keys, key_ok, d, d_ok, kv_head,
                            block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
        visible = (keys[None, :] >= first[:, None]) & (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, softcap, BF16, BF16_DOT, SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :], out, mask=q_mask)


def check_paged_operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
) -> None:
    """The checks both attention launchers share: pools, block tables, sequence lengths and q's heads."""
    check_tensor("q", q, ndim=3, dtypes=QUERY_DTYPES)
    device = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=POOL_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    check_dim("k_cache", k_cache.shape[3], head_dim, "head_dim (dim 3)")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of k_cache's {num_kv_heads} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_unit_stride(name, t)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(INDEX_DTYPE,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(INDEX_DTYPE,), device=device)
    check_dim("block_tables", block_tables.shape[0], num_seqs, "rows (sequences)")
    check_dim("seq_lens", seq_lens.shape[0], num_seqs, "length (sequences)")
    check_unit_stride("block_tables", block_tables)


def check_window_and_cap(sliding_window: int | None, logit_softcap: float | None) -> None:
    """The options both attention launchers share: None or 0 turns either off."""
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (no window) or positive, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap >= 0:  # NaN too
        raise ValueError(f"logit_softcap must be None, 0 (no cap) or positive, got {logit_softcap}")


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over the cache -> float32 [T, H, D] (see the module docstring).

    ``block_tables`` [B, max_blocks], ``query_start_loc`` [B+1] and ``seq_lens`` [B] are int32 on
    q's device, as ``ForwardBatch`` holds them. ``sliding_window`` None or 0: no window.
    ``max_query_len``: the longest run of new rows, when the caller knows it (saves a device sync).
    ``logit_softcap`` None or 0: scores uncapped; else ``cap * tanh(scores / cap)`` before the mask.
    """
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(INDEX_DTYPE,), device=q.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold B+1 prefix sums, got an empty tensor")
    check_paged_operands(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    check_window_and_cap(sliding_window, logit_softcap)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        raise ValueError(f"max_query_len must be positive, got {max_query_len}")
    bf16 = k_cache.dtype == torch.bfloat16
    block_d = next_pow2(head_dim, 16)
    cpu = interpreted(_prefill_attention_kernel)
    grid = (num_seqs, triton.cdiv(max_query_len, BLOCK_M), num_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        float(scale), int(sliding_window or 0), float(logit_softcap or 0.0), k_cache.shape[1],
        num_heads // k_cache.shape[2], head_dim,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=key_tile(block_d, cpu), BLOCK_D=block_d,
        BF16=bf16, BF16_DOT=bf16 and not cpu, SOFTCAP=bool(logit_softcap),
    )  # fmt: skip
    return out


def reference_prefill_attention(
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
    """The contract the CPU kernel has (kernels/cpu/paged_attention.py's reference, float64 ->
    float32 [T, H, D]), on q's device; ``round_query`` and ``logit_softcap`` as there."""
    cpu = [t.cpu() for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)]
    return paged_attention_reference(*cpu, scale, sliding_window, round_query, logit_softcap).to(q.device)
