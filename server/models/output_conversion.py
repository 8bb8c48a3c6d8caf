"""Engine output to ``protoserve.v1`` messages: deltas, finished choices, usage, stats and logprobs.

:class:`CollectedOutput` gathers one request's engine outputs, so that streaming and unary handlers
report usage from one place; :class:`OutputConverter` turns them into protos, with token texts
decoded by the model's tokenizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protoserve.engine.api import (
    Choice,
    CompletionDelta,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    RequestStats,
)
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from protoserve.engine.runtime import Tokenizer

FINISH_REASONS: dict[FinishReason | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def stop_reason_text(stop_reason: str | int | None) -> str:
    """The stop string, or the stop token id as text, or ""."""
    return "" if stop_reason is None else str(stop_reason)


def stats_to_proto(stats: RequestStats | None) -> pb.RequestStats:
    """Engine RequestStats → proto RequestStats."""
    if stats is None:
        return pb.RequestStats()
    return pb.RequestStats(
        queue_time_s=stats.queue_time_s,
        time_to_first_token_s=stats.time_to_first_token_s,
        prefill_time_s=stats.prefill_time_s,
        decode_time_s=stats.decode_time_s,
        e2e_time_s=stats.e2e_time_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
        kv_blocks=stats.kv_blocks,
        kv_bytes=stats.kv_bytes,
        preemptions=stats.preemptions,
        truncated_prompt_tokens=stats.truncated_prompt_tokens,
        model_load_seconds=stats.model_load_s,
        **_spec_stats(stats),
    )


def _spec_stats(stats: RequestStats) -> dict[str, int]:
    """The speculative counts, where the generated RequestStats has them (gen/ from before them lacks them)."""
    names = ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    fields = pb.RequestStats.DESCRIPTOR.fields_by_name
    return {name: getattr(stats, name) for name in names if name in fields}


@dataclass
class CollectedOutput:
    """One engine request's outputs collected: choices, prompt size and stats.

    Streaming handlers feed it as they forward deltas, unary handlers read it at
    the end; either way usage comes from one place.
    """

    n: int
    choices: list[Choice] = field(init=False)
    num_prompt_tokens: int = 0
    stats: RequestStats | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n)]

    def add(self, output: RequestOutput) -> None:
        for delta in output.deltas:
            self.choices[delta.index].add(delta)
        if output.num_prompt_tokens:
            self.num_prompt_tokens = output.num_prompt_tokens
        if output.stats is not None:
            self.stats = output.stats
        self.finished = self.finished or output.finished

    @property
    def prompt_tokens(self) -> int:
        if self.stats is not None and self.stats.prompt_tokens:
            return self.stats.prompt_tokens
        return self.num_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_prompt_tokens(self) -> int:
        return self.stats.cached_prompt_tokens if self.stats is not None else 0

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )


class OutputConverter:
    """One model's engine outputs → protos, naming the model and decoding token texts."""

    def __init__(self, tokenizer: Tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Decoding one id is pure; logprob-heavy streams ask for the same ids over and over.
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes a token stands for (may be part of a character)."""
        return bytes(self.tokenizer.token_bytes(token_id))

    def logprobs_to_proto(self, positions: Iterable[PositionLogprobs]) -> list[pb.PositionLogprobs]:
        """Engine logprobs → proto PositionLogprobs with token texts."""
        out = []
        for pos in positions:
            out.append(
                pb.PositionLogprobs(
                    chosen=self._token_logprob(pos.chosen.token_id, pos.chosen.logprob),
                    top=[self._token_logprob(t.token_id, t.logprob) for t in pos.top],
                )
            )
        return out

    def _token_logprob(self, token_id: int, logprob: float) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=token_id, token=self.token_text(token_id), logprob=logprob)

    def delta_to_proto(self, delta: CompletionDelta) -> pb.GenerateDelta:
        """One engine delta → proto GenerateDelta."""
        return pb.GenerateDelta(
            index=delta.index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=self.logprobs_to_proto(delta.logprobs),
        )

    def final_to_proto(self, result: CollectedOutput) -> pb.GenerateFinal:
        """The last stream message: finish reasons, usage and stats."""
        return pb.GenerateFinal(
            choices=[
                pb.ChoiceFinish(
                    index=c.index,
                    finish_reason=FINISH_REASONS[c.finish_reason],
                    stop_reason=stop_reason_text(c.stop_reason),
                )
                for c in result.choices
            ],
            usage=result.usage(),
            stats=stats_to_proto(result.stats),
            model=self.model_name,
        )

    def response_to_proto(self, request_id: str, result: CollectedOutput) -> pb.GenerateResponse:
        """A finished request → proto GenerateResponse."""
        return pb.GenerateResponse(
            request_id=request_id,
            model=self.model_name,
            choices=[
                pb.Choice(
                    index=c.index,
                    text=c.text,
                    token_ids=c.token_ids,
                    logprobs=self.logprobs_to_proto(c.logprobs),
                    finish_reason=FINISH_REASONS[c.finish_reason],
                    stop_reason=stop_reason_text(c.stop_reason),
                )
                for c in result.choices
            ],
            usage=result.usage(),
            stats=stats_to_proto(result.stats),
        )
