"""Which rows of a step's logits each sequence that samples reads.

The model runner returns, in batch order, a logits row for each sequence whose new tokens
reach its last token, then one more after each of its drafts (build_forward_batch). A
sequence without drafts samples its next token from its one row; a sequence with drafts
verifies them over its rows (engine/speculative/speculator.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protoserve.engine.scheduling.scheduler import ScheduledBatch
from protoserve.engine.scheduling.sequence import Sequence


@dataclass(frozen=True)
class SampleRow:
    """A sequence sampling one token this step: from logits row ``logits_row``, under grammar mask row
    ``mask_row`` (its place among the step's SampleRows; a choice forked off it shares both)."""

    seq: Sequence
    logits_row: int
    mask_row: int


@dataclass(frozen=True)
class DraftRows:
    """A sequence verifying its drafts this step over the logits rows ``rows`` (one more than its drafts)."""

    seq: Sequence
    rows: slice


@dataclass
class StepRows:
    """The step's sampling sequences, split by how they read their logits."""

    plain: list[SampleRow]
    drafted: list[DraftRows]

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepRows:
        """The batch's layout; read it before the forward moves the computed counts (Scheduler.finish_step)."""
        plain: list[SampleRow] = []
        drafted: list[DraftRows] = []
        row = 0
        for i, seq in enumerate(batch.seqs):
            if not batch.samples(i):
                continue
            if seq.num_draft_tokens:
                drafted.append(DraftRows(seq, slice(row, row + 1 + seq.num_draft_tokens)))
            else:
                plain.append(SampleRow(seq, row, len(plain)))
            row += 1 + seq.num_draft_tokens
        return cls(plain, drafted)


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without the copy when ``rows`` is every row in order (a plain decode step): at 64
    rows of a 49k vocabulary the copy alone is 12 MB, a few ms of a step's host time."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits
    return logits[rows]
