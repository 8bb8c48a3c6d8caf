"""A MoE block's routed experts in one C++ call (``kernels/cpu/moe_experts.cpp``), and its reference.

``bind`` hands every expert's packed gate_up ([2I, H], gate rows then up) and
down ([H, I]) weights to the extension once; ``grouped_experts`` then runs a
batch's (token, slot) pairs grouped by expert, scaled by their routing weights
and summed per token in slot order, releasing the GIL. Float32 activations only;
callers keep their PyTorch path where ``available()`` is False.

``reference_grouped_experts`` is the definition in plain PyTorch, each pair on
its own over ``packed_linear.reference_linear`` (float64 products of the packs'
own values), for tests and machines without the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from protoserve.kernels.cpu import packed_linear
from protoserve.kernels.cpu.extension import load


@dataclass(frozen=True)
class ExpertWeights:
    """Every expert's packs of one block as the extension takes them."""

    gate_up: list[Any]  # ext.LinearWeights per expert, [2I, H]
    down: list[Any]  # ext.LinearWeights per expert, [H, I]
    hidden_size: int
    intermediate_size: int


def available() -> bool:
    return load("moe_experts") is not None


def _ext_weights(ext: Any, packed: packed_linear.PackedWeight, bias: torch.Tensor | None) -> Any:
    return ext.LinearWeights(
        format=packed_linear.FORMATS[packed.format],
        data=packed.data,
        scales=packed.scales,
        mins=packed.mins,
        bias=None if bias is None else bias.detach().float().contiguous(),
        out_features=packed.out_features,
        group_size=packed.group_size,
    )


Pack = tuple[packed_linear.PackedWeight, torch.Tensor | None]


def bind(gate_up: Sequence[Pack], down: Sequence[Pack]) -> ExpertWeights:
    """Each expert's (pack, bias) pairs, gate_up [2I, H] and down [H, I], checked for one shape."""
    ext = load("moe_experts")
    if ext is None:
        raise RuntimeError("the CPU MoE experts kernel is not available on this machine")
    if not gate_up or len(gate_up) != len(down):
        raise ValueError(f"gate_up and down need one pack per expert, got {len(gate_up)} and {len(down)}")
    hidden, two_i = gate_up[0][0].in_features, gate_up[0][0].out_features
    for e, ((gu, _), (dn, _)) in enumerate(zip(gate_up, down, strict=True)):
        if (gu.out_features, gu.in_features) != (two_i, hidden):
            raise ValueError(
                f"expert {e} gate_up is [{gu.out_features}, {gu.in_features}], expected [{two_i}, {hidden}]"
            )
        if (dn.out_features, dn.in_features) != (hidden, two_i // 2):
            raise ValueError(
                f"expert {e} down is [{dn.out_features}, {dn.in_features}], expected [{hidden}, {two_i // 2}]"
            )
    return ExpertWeights(
        [_ext_weights(ext, p, b) for p, b in gate_up],
        [_ext_weights(ext, p, b) for p, b in down],
        hidden,
        two_i // 2,
    )


def grouped_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """x [T, H] float32, expert_ids int64 / weights float32 [T, k] -> float32 [T, H]."""
    return load("moe_experts").moe_experts(
        x.contiguous(), expert_ids.contiguous(), weights.float().contiguous(), experts.gate_up, experts.down
    )


def reference_grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Sequence[packed_linear.PackedWeight],
    down: Sequence[packed_linear.PackedWeight],
) -> torch.Tensor:
    """The definition, pair by pair: sum over slots s of ``weights[t, s] * down_e(silu(gate_e) * up_e)(x[t])``
    with e = ``expert_ids[t, s]``, the products as ``reference_linear`` computes them."""
    t, k = expert_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32)
    for token in range(t):
        for s in range(k):
            e = int(expert_ids[token, s])
            h = packed_linear.reference_linear(x[token : token + 1].float(), gate_up[e])
            gate, up = h.chunk(2, dim=-1)
            y = packed_linear.reference_linear(F.silu(gate) * up, down[e])
            out[token] += weights[token, s].float() * y[0]
    return out
