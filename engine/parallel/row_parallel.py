"""A row-parallel layer: this rank's partial product, summed over the ranks, plus the bias once.

The wrapped layer holds the rank's slice of the input columns (and no bias); its output is a
partial sum of the full product, which ``all_reduce`` completes on every rank. The bias is
added after the sum so that it counts once, not once per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class RowParallel(nn.Module):
    """``all_reduce(layer(x)) + bias`` over the default process group."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x).contiguous()
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"all_reduce over {dist.get_world_size() if dist.is_initialized() else '?'} ranks"
