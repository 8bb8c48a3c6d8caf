"""Multi-LoRA in one forward: the batch's token rows grouped by adapter, one low-rank product per group.

Rows of different adapters (and rows with none) share the base layers' GEMMs; each adapter
adds ``(x[rows] @ A.T) @ B.T`` to its own rows of the base output (the S-LoRA / Punica
idea, here as a gather, two small GEMMs and an index_add per group). Rows with no adapter
are left exactly as the base computed them.

In deterministic mode the two products run on fixed row tiles (``tiled_linear``), so a
row's delta, like its base output, does not depend on how many rows share its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protoserve.engine.lora.adapter import LoraAdapter
from protoserve.engine.lora.stack import NO_ADAPTER, AdapterStack
from protoserve.engine.models.linear import tiled_linear


@dataclass(frozen=True)
class AdapterGroup:
    adapter: LoraAdapter
    rows: torch.Tensor | None  # [n] int64 rows of the batch; None: every row


@dataclass(frozen=True)
class LoraBatch:
    """The adapter groups of one forward batch."""

    groups: tuple[AdapterGroup, ...]
    deterministic: bool

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


@dataclass(frozen=True)
class LayerLora:
    """One decoder layer's view of a LoraBatch."""

    batch: LoraBatch
    index: int

    def add(self, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of fused layer ``fused`` on ``x``) plus each row's adapter delta."""
        for group in self.batch.groups:
            delta = group.adapter.deltas.get((self.index, fused))
            if delta is None:  # this adapter does not target the layer
                continue
            xs = x if group.rows is None else x.index_select(0, group.rows)
            xs = xs.to(delta.a.dtype)
            if self.batch.deterministic:
                d = tiled_linear(tiled_linear(xs, delta.a, None), delta.b, None)
            else:
                d = F.linear(F.linear(xs, delta.a), delta.b)
            d = d.to(y.dtype)
            if group.rows is None:
                y = y + d
            else:
                y = y.index_add(0, group.rows, d)
        return y


def group_rows(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, rows) for each adapter slot used in ``token_slots`` [T], in slot order; rows None when
    every row uses that slot."""
    slots = torch.unique(token_slots).tolist()
    if slots == [NO_ADAPTER]:
        return []
    if len(slots) == 1:
        return [(slots[0], None)]
    return [(s, torch.nonzero(token_slots == s).flatten()) for s in slots if s != NO_ADAPTER]


def lora_batch(token_slots: torch.Tensor | None, stack: AdapterStack | None, deterministic: bool) -> LoraBatch | None:
    """The LoraBatch of a forward whose rows use ``token_slots``; None when no row has an adapter."""
    if token_slots is None or stack is None:
        return None
    groups = group_rows(token_slots)
    if not groups:
        return None
    adapters = stack.adapters_for([s for s, _ in groups])
    return LoraBatch(tuple(AdapterGroup(adapters[s], rows) for s, rows in groups), deterministic)
