"""Token bitmasks: which tokens each constrained row may take next, and applying them to a logits row.

A bitmask row is ``ceil(V / 32)`` int32 words, bit ``t % 32`` of word ``t // 32``
set when token t is allowed (llguidance's layout). The masks a step needs depend
only on the matchers' state after the previous step's tokens, so the engine asks
for them before the forward and collects them after: llguidance fills them on its
own threads with the GIL released while the forward runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

# llguidance.numpy, not llguidance.torch: the torch module decorates a kernel we do not use with
# torch.compile at import, which imports torch._dynamo (~1.8 s of every server's and CLI's start).
from llguidance.numpy import (
    allocate_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

NEG_INF = float("-inf")


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One bitmask row as a bool vector of ``vocab_size`` (True = allowed)."""
    return torch.from_numpy(_unpack(bits.numpy(), vocab_size))


def apply_token_mask(row: torch.Tensor, bits: torch.Tensor) -> None:
    """Make every token the bitmask row disallows impossible, in place (float32 row on the CPU).

    NumPy rather than torch: one thread, no OpenMP wake-up for a 50k-element row.
    """
    disallowed = _unpack(~bits.numpy(), row.shape[0])
    np.copyto(row.numpy(), NEG_INF, where=disallowed)


def masked_argmax(rows: np.ndarray, bits: torch.Tensor) -> list[int]:
    """Per row of float logits ``[R, V]``: the first most likely token among those its bitmask allows."""
    allowed = _unpack(bits.numpy(), rows.shape[1])
    return np.where(allowed, rows, NEG_INF).argmax(axis=1).tolist()


def _unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmask words (``[..., W]`` int32) as bools ``[..., vocab_size]``."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].view(np.bool_)


_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


def shared_executor() -> LLExecutor:
    """llguidance's thread pool, one per process (each engine's masks are filled on it)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = LLExecutor()
        return _executor


class MaskFiller:
    """Fills a step's bitmasks on llguidance's thread pool, from one worker thread of our own."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._worker: ThreadPoolExecutor | None = None

    def start(self, matchers: Sequence[LLMatcher | None]) -> Future[torch.Tensor]:
        """Begin filling one bitmask row per entry (rows of ``None`` stay all-allowed and unused)."""
        return self._submit(self._fill, list(matchers))

    def start_drafted(self, jobs: Sequence[tuple[LLMatcher, list[int]]]) -> Future[list[torch.Tensor]]:
        """Begin filling the masks of rows that verify drafts: per (matcher, drafts), ``1 + len(drafts)``
        rows, row i for the matcher after its first i drafts; each matcher is left where it was."""
        return self._submit(self._fill_drafted, [(m, list(d)) for m, d in jobs])

    def _submit(self, fill: Callable[[Any], Any], work: Any) -> Future[Any]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._worker.submit(fill, work)

    def _fill_drafted(self, jobs: list[tuple[LLMatcher, list[int]]]) -> list[torch.Tensor]:
        sizes = [1 + len(drafts) for _, drafts in jobs]
        bitmask = allocate_token_bitmask(sum(sizes), self.vocab_size)
        starts = itertools.accumulate([0, *sizes[:-1]])
        fill_next_token_bitmask_par_with_draft_tokens(
            shared_executor(), [(m, start, drafts) for (m, drafts), start in zip(jobs, starts, strict=True)], bitmask)
        return list(torch.from_numpy(bitmask).split(sizes))

    def _fill(self, matchers: list[LLMatcher | None]) -> torch.Tensor:
        bitmask = allocate_token_bitmask(len(matchers), self.vocab_size)
        jobs = [(m, i) for i, m in enumerate(matchers) if m is not None]
        fill_next_token_bitmask_par(shared_executor(), jobs, bitmask)
        return torch.from_numpy(bitmask)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)
