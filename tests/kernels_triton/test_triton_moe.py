"""kernels/triton/moe.py: fused MoE experts over (token, expert) pairs sorted by expert.

``align_pairs``: every pair exactly once, each block one expert, pairs in token order within an
expert, no block for an expert without pairs. ``fused_moe`` against the plain pair-by-pair float64
reference for top-1 and top-2 routing, float32 and bfloat16 experts, hidden and intermediate
sizes that are not multiples of the tiles, an expert that gets no tokens, and an expert with
more pairs than one block holds; plus an independent dense check (every expert run on every
token, masked by the routing) so the reference itself is pinned.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from protoserve.kernels.triton import moe  # noqa: E402


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, g: torch.Generator):
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w_gate_up, w_down


def routing(num_tokens: int, num_experts: int, top_k: int, g: torch.Generator, skip: int | None = None):
    """top_k distinct experts per token (never ``skip``), softmax weights renormalised."""
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip is not None:
        logits[:, skip] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


def test_align_pairs_layout() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [2, 3], [0, 2]])  # expert 1 gets nothing
    blocks = moe.align_pairs(ids, num_experts=4, block_m=2)
    pairs, owners = blocks.sorted_pairs.view(-1, 2), blocks.block_experts
    flat = ids.reshape(-1)
    assert blocks.num_pairs == 8
    real = blocks.sorted_pairs[blocks.sorted_pairs < 8]
    assert sorted(real.tolist()) == list(range(8))  # every pair once
    for block, owner in zip(pairs.tolist(), owners.tolist(), strict=True):
        members = [p for p in block if p < 8]
        if owner < 0:
            assert not members  # unused tail blocks hold only the sentinel
        else:
            assert members and all(int(flat[p]) == owner for p in members)
    assert 1 not in owners.tolist()
    assert owners.tolist()[:5] == [0, 0, 2, 2, 3]
    assert real.tolist() == [1, 2, 6, 0, 3, 4, 7, 5]  # expert order, token order within an expert


def dense_moe(x, w_gate_up, w_down, ids, weights) -> torch.Tensor:
    """Every expert on every token in float64, masked by the routing: an independent definition."""
    inter = w_gate_up.shape[1] // 2
    h = torch.einsum("eih,th->eti", w_gate_up.double(), x.to(w_gate_up.dtype).double())
    act = F.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("ehi,eti->eth", w_down.double(), act)  # [E, T, H]
    gate = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=torch.float64)
    gate.scatter_add_(1, ids, weights.double())
    return torch.einsum("te,eth->th", gate, y).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_matches_reference(top_k: int, dtype: torch.dtype, device) -> None:
    g = torch.Generator().manual_seed(top_k)
    num_tokens, hidden, inter, num_experts = 21, 40, 24, 4  # 40, 24: not multiples of the 32-wide tiles
    x = torch.randn(num_tokens, hidden, generator=g)
    w_gate_up, w_down = experts(num_experts, hidden, inter, dtype, g)
    ids, weights = routing(num_tokens, num_experts, top_k, g, skip=1)  # expert 1: no tokens
    assert 1 not in ids.reshape(-1).tolist()
    out = moe.fused_moe(x.to(device), w_gate_up.to(device), w_down.to(device), ids.to(device), weights.to(device))
    out = out.cpu()
    ref = moe.reference_fused_moe(x, w_gate_up, w_down, ids, weights)
    assert out.dtype == torch.float32 and out.shape == x.shape
    # bfloat16: summing in another order may round an element of silu(gate) * up to the bf16
    # value next door, 2^-8 relative; float32 multiplies and sums exactly enough for 1e-5.
    atol = 1e-5 if dtype == torch.float32 else 2**-8 * ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol)
    if dtype == torch.float32:
        torch.testing.assert_close(ref, dense_moe(x, w_gate_up, w_down, ids, weights), rtol=1e-5, atol=1e-6)
    else:  # the bfloat16 intermediate is a real rounding, within its ulp of the exact product
        exact = dense_moe(x, w_gate_up, w_down, ids, weights)
        torch.testing.assert_close(out, exact, rtol=2**-7, atol=2**-7 * exact.abs().max().item())
        assert (out - exact).abs().max().item() > 1e-6


def test_one_expert_many_tokens(device) -> None:
    """40 tokens all on expert 3: its pairs fill three blocks, the other experts none."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 16, generator=g)
    w_gate_up, w_down = experts(4, 16, 32, torch.float32, g)
    ids = torch.full((40, 1), 3)
    weights = torch.rand(40, 1, generator=g)
    blocks = moe.align_pairs(ids, 4)
    assert (blocks.block_experts == 3).sum().item() == 3
    out = moe.fused_moe(
        x.to(device), w_gate_up.to(device), w_down.to(device), ids.to(device), weights.to(device),
        pairs=moe.align_pairs(ids.to(device), 4),
    ).cpu()  # fmt: skip
    torch.testing.assert_close(out, moe.reference_fused_moe(x, w_gate_up, w_down, ids, weights), rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_field(device) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, device=device)
    w_gate_up, w_down = (t.to(device) for t in experts(2, 16, 8, torch.float32, g))
    ids = torch.tensor([[0], [1], [0]], device=device)
    weights = torch.ones(3, 1, device=device)
    with pytest.raises(ValueError, match=r"expert_ids must lie in 0\.\.1, got 1\.\.2"):
        moe.fused_moe(x, w_gate_up, w_down, ids + 1, weights)
    with pytest.raises(ValueError, match="w_down must be"):
        moe.fused_moe(x, w_gate_up, w_down[:, :8], ids, weights)
    with pytest.raises(ValueError, match="w_gate_up: hidden size"):
        moe.fused_moe(x[:, :8], w_gate_up, w_down, ids, weights)
    with pytest.raises(ValueError, match="weights has shape"):
        moe.fused_moe(x, w_gate_up, w_down, ids, weights[:, :0])
    with pytest.raises(ValueError, match="weights must be float32"):
        moe.fused_moe(x, w_gate_up, w_down, ids, weights.double())
    with pytest.raises(ValueError, match="expert_ids: rows"):
        moe.fused_moe(x, w_gate_up, w_down, ids[:2], weights[:2])
    with pytest.raises(ValueError, match="pairs were aligned for 2 pairs"):
        moe.fused_moe(x, w_gate_up, w_down, ids, weights, pairs=moe.align_pairs(ids[:2], 2))
