"""Draft-model drafting: a smaller (or lower-precision) model sharing the target's tokenizer.

The draft model keeps its own paged KV cache and block pool (no prefix cache): per
sequence, the tokens whose draft K/V are written. Each step it catches a sequence up
on what the target emitted since (usually the last sampled token plus the drafts that
were accepted, whose K/V it already wrote, so one token), then drafts greedily, one
batched single-token forward per draft. What it writes for a draft that is later
rejected is simply not counted: the next step keeps only the K/V of positions whose
tokens still match. Drafts are argmax tokens of the draft model; verification keeps
the target's distribution whatever proposes (speculator.py, Speculator.verify).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protoserve.engine.config import EngineConfig
from protoserve.engine.execution.model_runner import ModelRunner
from protoserve.engine.loader.load import LoadedModel
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.sequence import Sequence


@dataclass(eq=False)
class DraftState:
    """One sequence as the draft model sees it: the tokens it wrote K/V for, and where."""

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # build_forward_batch's view: the draft model verifies nothing

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class DraftModelProposer:
    """Greedy drafts from a second model, batched over the step's speculative sequences."""

    def __init__(self, draft: LoadedModel, block_size: int, num_blocks: int) -> None:
        config = EngineConfig(block_size=block_size, max_kv_blocks=num_blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(draft.model, draft.config, config, draft.dtype, draft.quantization)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.vocab_size = draft.config.vocab_size
        self.states: dict[int, DraftState] = {}  # by seq_id

    def release(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.blocks.free(state.block_table)

    def propose_batch(self, requests: list[tuple[Sequence, int]], live: set[int]) -> list[list[int]]:
        """Up to ``k`` greedy drafts for each (sequence, k); ``live`` are the seq ids still running
        (the states of any other are freed first)."""
        for seq_id in [s for s in self.states if s not in live]:
            self.release(seq_id)
        drafts: list[list[int]] = [[] for _ in requests]
        views: list[DraftState] = []
        rows: list[int] = []
        for i, (seq, k) in enumerate(requests):
            if k < 1:
                continue
            state = self.states.setdefault(seq.seq_id, DraftState())
            # Keep the K/V of positions whose token is unchanged; the last token is always fed again.
            keep = common_prefix(state.token_ids, seq.token_ids, min(state.num_computed_tokens, seq.num_tokens - 1))
            state.token_ids = list(seq.token_ids)
            state.num_computed_tokens = keep
            self.blocks.truncate(state.block_table, self.blocks.blocks_for(keep))
            if not self.blocks.allocate(state.block_table, state.num_tokens + k - 1):
                self.release(seq.seq_id)  # the draft pool is full: this sequence decodes plainly
                continue
            views.append(state)
            rows.append(i)
        if not views:
            return drafts
        new = [v.num_tokens - v.num_computed_tokens for v in views]
        while views:
            logits = self.runner.execute(views, new)
            tokens = logits.argmax(dim=1).tolist()
            still_views, still_rows = [], []
            for view, row, n, token in zip(views, rows, new, tokens, strict=True):
                view.num_computed_tokens += n
                view.token_ids.append(token)
                drafts[row].append(token)
                if len(drafts[row]) < requests[row][1]:
                    still_views.append(view)
                    still_rows.append(row)
            views, rows, new = still_views, still_rows, [1] * len(still_views)
        return drafts
