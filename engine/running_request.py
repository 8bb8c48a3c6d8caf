"""RunningRequest: a live request's choices, their text streams, timing and stats.

The engine feeds it sampled tokens; it turns them into CompletionDeltas
(detokenized, stop strings held back and cut) and, once every choice has
ended, into the finishing RequestOutput with RequestStats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protoserve.engine.errors import EngineError
from protoserve.engine.request import (
    CompletionDelta,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    RequestStats,
    TokenizedRequest,
)
from protoserve.engine.sampling.detokenizer import IncrementalDetokenizer
from protoserve.engine.sampling.stop_checker import StopStringMatcher
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.tracing import RequestSpan

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio increment: choice seeds far apart in the 64-bit space


def choice_generator(seed: int | None, index: int) -> torch.Generator:
    """Choice ``index``'s own generator: derived from the request seed, or fresh entropy without one.

    Choice 0 uses the seed itself, so ``n=1`` with seed s is the plain seeded stream.
    """
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed + index * _SEED_STRIDE) % 2**64)
    return g


@dataclass
class ChoiceStream:
    """Output of one choice not yet reported, plus the decoders that produce its text."""

    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    reported_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token_id: int, logprobs: PositionLogprobs | None, render: bool) -> str | None:
        """Record a token; returns the stop string if its text completed one. ``render=False`` for stop tokens."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if not render:
            return None
        text, stop = self.stops.push(self.detokenizer.push(token_id))
        self.text.append(text)
        return stop

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End the choice. Text held back for a possible stop string is released unless
        a stop string matched (everything from it on is dropped) or the choice was cancelled."""
        if self.finished:
            return
        self.finish_reason, self.stop_reason = reason, stop_reason
        if reason == FinishReason.CANCELLED or isinstance(stop_reason, str):
            return
        self._release_text()

    def abandon(self) -> None:
        """End the choice because its request failed. Held-back text is released, so the text
        reported matches the token ids reported; no finish reason is reported (the error is the end)."""
        if not self.finished:
            self.finish_reason = FinishReason.CANCELLED
            self._release_text()
        self.reported_finish = True

    def _release_text(self) -> None:
        text, stop = self.stops.push(self.detokenizer.flush())
        self.text.append(text if stop is not None else text + self.stops.flush())

    def take_delta(self) -> CompletionDelta | None:
        """What is new since the last call, or None when nothing is."""
        report_finish = self.finished and not self.reported_finish
        if not (self.token_ids or report_finish or any(self.text)):
            return None
        delta = CompletionDelta(
            index=self.index,
            text="".join(self.text),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason if report_finish else None,
            stop_reason=self.stop_reason if report_finish else None,
        )
        self.reported_finish = self.reported_finish or report_finish
        self.token_ids, self.text, self.logprobs = [], [], []
        return delta


class RunningRequest:
    """Everything the engine tracks for one request between add_request and its final output."""

    def __init__(
        self,
        request: TokenizedRequest,
        prompt_token_ids: list[int],
        truncated: int,
        token_bytes: Callable[[int], bytes],
        skip_token_ids: frozenset[int],
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt_token_ids = prompt_token_ids
        n = request.sampling.n
        self.generators = [choice_generator(request.sampling.seed, i) for i in range(n)]
        skip = skip_token_ids if request.sampling.skip_special_tokens else frozenset()
        self.choices = [
            ChoiceStream(i, IncrementalDetokenizer(token_bytes, skip), StopStringMatcher(request.sampling.stop))
            for i in range(n)
        ]
        self.seqs: list[Sequence] = []
        self.stats = RequestStats(prompt_tokens=len(prompt_token_ids), truncated_prompt_tokens=truncated)
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.cached_tokens_recorded = False
        self.cancelled = False
        self.error: EngineError | None = None  # why the request failed while generating
        self.output_sent_final = False
        self.span: RequestSpan | None = None  # set by the engine for traced requests
        self.awaiting_schedule = True  # queued, or preempted and queued again

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def started(self) -> bool:
        return self.first_scheduled is not None

    def note_scheduled(self, now: float, prefix_hit_tokens: int | None) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = now
        if prefix_hit_tokens is not None and not self.cached_tokens_recorded:
            self.stats.cached_prompt_tokens = prefix_hit_tokens
            self.cached_tokens_recorded = True
        if self.awaiting_schedule:
            self.awaiting_schedule = False
            if self.span is not None:
                self.span.scheduled(prefix_hit_tokens)

    def note_preempted(self) -> None:
        """One of its sequences lost its blocks (stats count preemptions per sequence at the end)."""
        self.awaiting_schedule = True
        if self.span is not None:
            self.span.preempted()

    def note_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
            if self.span is not None:
                self.span.first_token()
        elif now > self.last_token:
            # The n choices of one step share a timestamp: one interval per step, not per choice.
            self.stats.inter_token_latencies_s.append(now - self.last_token)
        self.last_token = now

    def note_blocks(self, block_bytes: int) -> None:
        """Track the most KV blocks held at once (shared prompt blocks counted once)."""
        live = [s.block_table for s in self.seqs if not s.is_finished]
        held = len(live[0]) if len(live) == 1 else len(set().union(*live)) if live else 0
        if held > self.stats.kv_blocks:
            self.stats.kv_blocks = held
            self.stats.kv_bytes = held * block_bytes

    def cancel(self) -> None:
        self.cancelled = True
        for choice in self.choices:
            choice.finish(FinishReason.CANCELLED)

    def fail(self, error: EngineError) -> None:
        """End every choice: the request's final output carries ``error`` instead of finish reasons."""
        self.error = error
        for choice in self.choices:
            choice.abandon()

    def make_output(self, now: float) -> RequestOutput | None:
        """The deltas since the last output; the final one (all choices ended) carries stats."""
        if self.output_sent_final:
            return None
        deltas = [d for d in (c.take_delta() for c in self.choices) if d is not None]
        finished = self.finished
        if not deltas and not finished:
            return None
        out = RequestOutput(
            request_id=self.request_id,
            deltas=deltas,
            finished=finished,
            num_prompt_tokens=len(self.prompt_token_ids),
        )
        if finished:
            self.output_sent_final = True
            out.stats = self._final_stats(now)
            out.error = self.error
        return out

    def _final_stats(self, now: float) -> RequestStats:
        s = self.stats
        arrival = self.request.arrival_time
        s.e2e_time_s = now - arrival
        if self.first_scheduled is not None:
            s.queue_time_s = self.first_scheduled - arrival
        if self.first_token is not None and self.first_scheduled is not None:
            s.time_to_first_token_s = self.first_token - arrival
            s.prefill_time_s = self.first_token - self.first_scheduled
            s.decode_time_s = now - self.first_token
        elif self.first_scheduled is not None:
            s.prefill_time_s = now - self.first_scheduled
        s.generated_tokens = sum(seq.num_generated for seq in self.seqs)
        s.preemptions = sum(seq.num_preemptions for seq in self.seqs)
        return s
