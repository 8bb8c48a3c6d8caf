"""Async scheduling: step N+1 is scheduled and launched while step N's forward and sampling run on the device.

As vLLM v1's async scheduling and SGLang's overlap scheduler do. An overlapped step samples on the
device and leaves the token ids there: each sequence gets a placeholder token on the host, so the
scheduler counts it and gives it its block, and the next step's forward reads the real ids straight
from the device tensor. The host learns them one step late, when it joins the step: it waits for
their copy (by then the device runs the next forward), puts each in its placeholder's place and
emits it, stop checks and all, as the plain step would have. A sequence that token ended (EOS, a stop
string or token, max_tokens, a cancel) had one more step computed, whose token is dropped, so the
output is token-identical to the plain step's.

Decided per step, simply. A step overlaps when every scheduled sequence samples in it on the batched
sampler with nothing the host must see first: no grammar, no speculative drafting, no choices still to
fork (n > 1 before the first token), no penalties (they read the tokens before), no field only the
host sampler applies (logprobs, logit bias, min_tokens holding tokens back, Mirostat, typical-p,
top-n-sigma, XTC); and, while a step is pending, nothing waits or is parked, no request was
cancelled, every running sequence is scheduled and the pool has a free block for each that needs
one. Otherwise the pending step is joined first and the step runs plain (LLMEngine._run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protoserve.engine.request import RequestOutput
from protoserve.engine.sampling.batched import batch_sampleable, sample_batch_tokens
from protoserve.engine.sampling.sampler import SampleResult
from protoserve.engine.scheduling.scheduler import ScheduledBatch
from protoserve.engine.scheduling.sequence import Sequence

if TYPE_CHECKING:
    from protoserve.engine.llm_engine import LLMEngine

# Stands on the host for a token sampled on the device and not yet read back. The forward never
# reads it (it takes the device's ids) and nothing is hashed or emitted over it before it is replaced.
PLACEHOLDER = 0


@dataclass
class PendingTokens:
    """One overlapped step's samples: ``tokens`` [rows] int64 on the device, ``row_of`` each still live
    sequence's row in it, and their copy to the host, ready once ``ready`` has passed."""

    seqs: list[Sequence]
    row_of: dict[int, int]  # seq_id -> row
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> PendingTokens:
        """Start the copy of ``tokens`` (row i is ``seqs[i]``'s) to the host, without waiting for it."""
        ready = None
        host = tokens
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return cls(list(seqs), {s.seq_id: i for i, s in enumerate(seqs)}, tokens, host, ready)

    def keep(self, live: list[Sequence]) -> PendingTokens:
        """The same step's samples, for ``live`` (a subset of its sequences) only."""
        return PendingTokens(live, {s.seq_id: self.row_of[s.seq_id] for s in live}, self.tokens, self.host,
                             self.ready)

    def wait(self) -> list[int]:
        """Each sequence's token, in ``seqs`` order (the host blocks until the copy has landed)."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        return [values[self.row_of[s.seq_id]] for s in self.seqs]

    def input_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        """The samples of ``seqs``, in that order, as the next forward's input ids (on the device)."""
        index = torch.tensor([self.row_of[s.seq_id] for s in seqs], dtype=torch.int64)
        return self.tokens.index_select(0, index.to(self.tokens.device, non_blocking=True))


class OverlappedSteps:
    """LLMEngine.step() with async scheduling: at most one step's samples pending at a time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pending: PendingTokens | None = None
        self.num_overlapped = 0  # steps launched before the step ahead of them was joined, and not
        self.num_plain = 0

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        start = time.monotonic()
        if self.pending is not None and not self._may_continue():
            self._join()
        batch = engine._schedule(start)  # drafts nothing while a step is pending: no running sequence drafts
        if not batch.is_empty and self._overlaps(batch):
            self.num_overlapped += self.pending is not None
            self._launch(batch)
        else:
            self.num_plain += not batch.is_empty
            if self.pending is not None:
                self._join()
                batch = _without_finished(batch)
            engine._run(batch)
        return engine._end_step(batch, start)

    def _eligible(self, seq: Sequence) -> bool:
        """The sequence's next token needs nothing from the host before it is sampled."""
        sp = seq.sampling
        return (seq.matcher is None and not seq.num_pending_forks and not seq.num_draft_tokens
                and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0
                and self.engine.speculator.params(seq) is None and batch_sampleable(seq))

    def _may_continue(self) -> bool:
        """Whether the next step can be scheduled before the pending one is joined: it will run exactly
        the pending sequences, one token each, without preempting any."""
        engine, pending = self.engine, self.pending
        assert pending is not None
        scheduler = engine.scheduler
        if scheduler.waiting or (engine.kv_offload is not None and engine.kv_offload.num_parked):
            return False
        if len(scheduler.running) != len(pending.seqs) or any(s.seq_id not in pending.row_of
                                                             for s in scheduler.running):
            return False  # a request was cancelled, or a sequence ended otherwise
        if len(scheduler.running) > engine.config.token_budget():
            return False
        bs = scheduler.block_size
        growing = sum(1 for s in scheduler.running if s.num_tokens > len(s.block_table) * bs)
        return growing <= engine.block_manager.num_free_blocks and all(map(self._eligible, scheduler.running))

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        """Whether this scheduled batch runs overlapped (else plain, after the pending step is joined)."""
        if batch.preempted or (self.pending is not None and len(batch.seqs) != len(self.pending.seqs)):
            return False
        for i, seq in enumerate(batch.seqs):
            if not batch.samples(i) or not self._eligible(seq):
                return False
            if self.pending is not None and (seq.seq_id not in self.pending.row_of or batch.num_new_tokens[i] != 1):
                return False
        return True

    def _launch(self, batch: ScheduledBatch) -> None:
        """Run the batch's forward and sampling without waiting for them; join the step before meanwhile."""
        engine = self.engine
        input_ids = self.pending.input_ids(batch.seqs) if self.pending is not None else None
        logits = engine.runner.execute(batch.seqs, batch.num_new_tokens, input_ids=input_ids)
        launched = PendingTokens.start(batch.seqs, sample_batch_tokens(logits, batch.seqs))
        if self.pending is not None:
            self._join()  # the host's turn, while the device runs this step
        batch = _without_finished(batch)  # ended by the token just joined: this step's token is dropped
        engine.scheduler.finish_step(batch)
        for seq in batch.seqs:
            seq.append_token(PLACEHOLDER)
        self.pending = launched.keep(batch.seqs) if batch.seqs else None

    def _join(self) -> None:
        """Read the pending step's tokens back and emit each as the plain step would have."""
        pending, self.pending = self.pending, None
        assert pending is not None
        tokens = pending.wait()
        now = time.monotonic()
        block_size = self.engine.scheduler.block_size
        for seq, token in zip(pending.seqs, tokens, strict=True):
            assert seq.token_ids[-1] == PLACEHOLDER
            seq.token_ids.pop()
            # Block hashes the scheduler may have memoized over the placeholder are recomputed.
            del seq.block_hashes[len(seq.token_ids) // block_size :]
            self.engine._emit(seq, SampleResult(token), now)  # nothing for a sequence ended since


def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    """The batch less the sequences that ended after it was scheduled (their blocks are freed)."""
    if not any(s.is_finished for s in batch.seqs):
        return batch
    kept = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if not s.is_finished]
    return ScheduledBatch([s for s, _ in kept], [n for _, n in kept], batch.preempted, batch.prefix_hit_tokens)
