"""Fused MoE experts: a batch's (token, expert) pairs sorted by expert, one program per expert block.

The routing layout is the engine's (engine/models/moe.py ``Routing``): ``expert_ids`` [T, k]
int64 and float32 ``weights`` [T, k]; pair ``p = t * k + s`` is token t's slot s. Every expert
is a SwiGLU MLP stacked with the others: ``w_gate_up`` [E, 2I, H] (gate rows then up rows) and
``w_down`` [E, H, I], float32 or bfloat16. Token t's output is the sum over its slots, in slot
order, of ``weights[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with e = ``expert_ids[t, s]``.

``align_pairs`` sorts the pairs by expert (stable, so an expert's pairs keep token order) and pads
each expert's run to a multiple of ``block_m`` with a sentinel pair, so every block of ``block_m``
sorted pairs belongs to one expert; an expert without pairs gets no block. It uses no host sync
beyond the expert-id range check, and its sizes depend on (T, k, E) alone. Two kernels follow, each one
program per (expert block, tile of output columns):

1. gate_up: the block's rows of x times the expert's gate and up rows, ``silu(gate) * up`` into
   an intermediate [T*k, I] in the weights' dtype (a bfloat16 expert rounds it to bfloat16, to
   nearest, before the down product, as a bfloat16 model does);
2. down: the intermediate times the expert's down rows, times the pair's routing weight, into
   float32 [T*k, H], one row per pair.

The slot-order sum per token is then k - 1 plain adds. x is rounded to the weights' dtype first.
Float32 experts multiply in IEEE float32 (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from protoserve.kernels.triton._common import (
    check_dim,
    check_tensor,
    check_unit_stride,
    interpreted,
    round_to_bf16,
)

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # pairs per expert block (tl.dot needs 16 rows on a GPU)


@dataclass(frozen=True)
class PairBlocks:
    """The pairs sorted by expert and padded per expert to whole blocks of ``block_m``.

    ``sorted_pairs`` [L] int32: pair ids in expert order, ``num_pairs`` where a block is padded.
    ``block_experts`` [L / block_m] int32: each block's expert, -1 for the unused blocks at the end
    (L is the bound ``num_pairs + min(E, num_pairs) * (block_m - 1)`` rounded up to a block).
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    num_pairs: int


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> PairBlocks:
    """Sort the (token, slot) pairs of ``expert_ids`` [T, k] by expert into blocks of ``block_m``."""
    check_tensor("expert_ids", expert_ids, ndim=2, dtypes=(torch.int64, torch.int32))
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    flat = expert_ids.reshape(-1).long()
    device = expert_ids.device
    num_pairs = flat.numel()
    if num_pairs and not (flat.is_cuda and torch.cuda.is_current_stream_capturing()):  # no read-back in a capture
        low, high = torch.stack(torch.aminmax(flat)).tolist()  # one read-back (a device sync) for both ends
        if low < 0 or high >= num_experts:
            raise ValueError(f"expert_ids must lie in 0..{num_experts - 1}, got {low}..{high}")
    # scatter_add, not bincount: bincount sizes its output from the data (a device sync on a GPU).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    experts = torch.searchsorted(ends, block_starts, right=True)  # the first expert ending after the block's start
    block_experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return PairBlocks(sorted_pairs, block_experts, block_m, num_pairs)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, pairs_ptr, experts_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at,
    BF16: tl.constexpr, BF16_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    token = pair // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        up = tl.load(w_base + (inter + cols)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if BF16_DOT:
            acc_gate += tl.dot(x, gate)
            acc_up += tl.dot(x, up)
        else:
            x = x.to(tl.float32)
            acc_gate += tl.dot(x, gate.to(tl.float32), input_precision="ieee")
            acc_up += tl.dot(x, up.to(tl.float32), input_precision="ieee")
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    if BF16:
        act = round_to_bf16(act)
    tl.store(
        act_ptr + pair[:, None] * stride_at + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=pair_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, route_ptr, out_ptr, pairs_ptr, experts_ptr,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_ot,
    BF16_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + pair[:, None] * stride_at + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if BF16_DOT:
            acc += tl.dot(a, w)
        else:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    route = tl.load(route_ptr + pair, mask=pair_ok, other=0.0)
    acc = acc * route[:, None]
    tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], acc, mask=pair_ok[:, None] & col_ok[None, :])


def _check_moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
) -> None:
    check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES)
    device = x.device
    check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=WEIGHT_DTYPES, device=device)
    check_tensor("w_down", w_down, ndim=3, dtypes=(w_gate_up.dtype,), device=device)
    num_experts, two_i, hidden = w_gate_up.shape
    if two_i % 2:
        raise ValueError(f"w_gate_up must stack gate and up rows [E, 2I, H], got {two_i} rows")
    check_dim("w_gate_up", hidden, x.shape[1], "hidden size (dim 2)")
    if tuple(w_down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w_down must be [{num_experts}, {hidden}, {two_i // 2}] (E, H, I), got {tuple(w_down.shape)}")
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_unit_stride(name, t)
    check_tensor("expert_ids", expert_ids, ndim=2, dtypes=(torch.int64, torch.int32), device=device)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=device)
    check_dim("expert_ids", expert_ids.shape[0], x.shape[0], "rows (tokens)")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expert_ids {tuple(expert_ids.shape)}")


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    pairs: PairBlocks | None = None,
) -> torch.Tensor:
    """The routed experts' output for x [T, H] -> float32 [T, H] (see the module docstring).

    ``pairs``: ``align_pairs(expert_ids, E)`` when the caller already has it (several layers
    routing alike, or a captured graph); built here otherwise.
    """
    _check_moe(x, w_gate_up, w_down, expert_ids, weights)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = expert_ids.shape[1]
    if pairs is None:
        pairs = align_pairs(expert_ids, num_experts)
    elif pairs.num_pairs != num_tokens * top_k or pairs.block_m != BLOCK_M:
        raise ValueError(f"pairs were aligned for {pairs.num_pairs} pairs in blocks of {pairs.block_m}, "
                         f"not {num_tokens * top_k} in blocks of {BLOCK_M}")
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out
    xw = x.to(w_gate_up.dtype).contiguous()
    bf16 = w_gate_up.dtype == torch.bfloat16
    act = torch.empty(pairs.num_pairs, inter, dtype=w_gate_up.dtype, device=x.device)
    per_pair = torch.empty(pairs.num_pairs, hidden, dtype=torch.float32, device=x.device)
    route = weights.reshape(-1).contiguous()
    blocks = pairs.block_experts.shape[0]
    cpu = interpreted(_gate_up_kernel)
    block_n, block_k = (32, 32) if cpu else (64, 64)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        xw, w_gate_up, act, pairs.sorted_pairs, pairs.block_experts,
        pairs.num_pairs, top_k, hidden, inter,
        xw.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        BF16=bf16, BF16_DOT=bf16 and not cpu,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w_down, route, per_pair, pairs.sorted_pairs, pairs.block_experts,
        pairs.num_pairs, hidden, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), per_pair.stride(0),
        BF16_DOT=bf16 and not cpu,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    slots = per_pair.view(num_tokens, top_k, hidden)
    out.copy_(slots[:, 0])
    for s in range(1, top_k):  # slot order, as the CPU block sums
        out += slots[:, s]
    return out


def reference_fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The definition pair by pair in float64 -> float32 [T, H]: x rounded to the weights' dtype,
    and for bfloat16 experts ``silu(gate) * up`` rounded to bfloat16 before the down product."""
    num_tokens, top_k = expert_ids.shape
    inter = w_gate_up.shape[1] // 2
    xw = x.to(w_gate_up.dtype).double().cpu()
    gu, dn = w_gate_up.double().cpu(), w_down.double().cpu()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for s in range(top_k):
            e = int(expert_ids[t, s])
            h = gu[e] @ xw[t]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            if w_gate_up.dtype == torch.bfloat16:
                act = act.float().bfloat16().double()
            out[t] += float(weights[t, s]) * (dn[e] @ act)
    return out.float().to(x.device)
