"""Request spans: one OpenTelemetry span per engine request, from queueing to its final output.

The caller (the server) decides whether a request is traced: it puts a
:class:`RequestTrace` on ``TokenizedRequest.trace`` holding the tracer and the
parent context (its gRPC server span). The context travels inside the request
because the step loop runs on its own thread, where the caller's contextvars
are not current. Untraced requests (``trace=None``) cost nothing here.

Attributes follow the OpenTelemetry GenAI conventions: the span is named
``"{gen_ai.operation.name} {gen_ai.request.model}"`` and carries the sampling
parameters, the response id, finish reasons and token usage. Events mark
``queued``, ``scheduled``, ``first_token``, ``preempted`` and ``finished``.
Prompt and completion text are recorded only when ``capture_content`` is set.

Only opentelemetry-api is used, so the engine needs no SDK.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

if TYPE_CHECKING:
    from protoserve.engine.request import FinishReason, RequestOutput, RequestStats, TokenizedRequest

# GenAI semantic-convention attribute names (kept here rather than imported from
# the incubating semconv module, whose layout changes between releases).
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
ENGINE_REQUEST_ID = "protoserve.engine.request_id"
# Speculative decoding's counts for the request (set only when it drafted): drafts verified, tokens
# drafted, tokens accepted; acceptance rate = accepted / drafted.
SPEC_NUM_DRAFTS = "protoserve.spec_decode.num_drafts"
SPEC_DRAFT_TOKENS = "protoserve.spec_decode.num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "protoserve.spec_decode.num_accepted_tokens"

TEXT_COMPLETION = "text_completion"
CHAT = "chat"
PROVIDER = "protoserve"


@dataclass(frozen=True)
class RequestTrace:
    """How to trace one request: where its span goes and how it is named."""

    tracer: trace.Tracer
    parent: Context  # carries the parent span (the gRPC server span)
    operation: str = TEXT_COMPLETION  # gen_ai.operation.name: "chat" or "text_completion"
    model: str = ""
    response_id: str = ""  # the id the caller sees; the engine's own id is an attribute too
    provider: str = PROVIDER
    capture_content: bool = False  # prompt and completion text as span attributes (opt-in)


def _request_attributes(trace_info: RequestTrace, request: TokenizedRequest) -> dict:
    sp = request.sampling
    attrs: dict = {
        OPERATION_NAME: trace_info.operation,
        PROVIDER_NAME: trace_info.provider,
        REQUEST_MODEL: trace_info.model,
        RESPONSE_MODEL: trace_info.model,
        RESPONSE_ID: trace_info.response_id or request.request_id,
        ENGINE_REQUEST_ID: request.request_id,
        REQUEST_TEMPERATURE: sp.temperature,
        REQUEST_TOP_P: sp.top_p,
    }
    # Unset or disabled parameters are left out rather than recorded as a misleading 0.
    if sp.max_tokens is not None:
        attrs[REQUEST_MAX_TOKENS] = sp.max_tokens
    if sp.top_k > 0:
        attrs[REQUEST_TOP_K] = sp.top_k
    if sp.seed is not None:
        attrs[REQUEST_SEED] = sp.seed
    if sp.frequency_penalty:
        attrs[REQUEST_FREQUENCY_PENALTY] = sp.frequency_penalty
    if sp.presence_penalty:
        attrs[REQUEST_PRESENCE_PENALTY] = sp.presence_penalty
    if sp.stop:
        attrs[REQUEST_STOP_SEQUENCES] = list(sp.stop)
    if sp.n != 1:
        attrs[REQUEST_CHOICE_COUNT] = sp.n
    return attrs


class RequestSpan:
    """The span of one request, driven by the engine thread as the request moves along."""

    def __init__(
        self,
        trace_info: RequestTrace,
        request: TokenizedRequest,
        num_prompt_tokens: int,
        prompt_text: Callable[[], str] | None = None,
    ) -> None:
        self.capture_content = trace_info.capture_content
        # The span starts when the request arrived (before validation and the hop to
        # this thread), so queue time shows up inside it.
        waited_ns = int(max(0.0, time.monotonic() - request.arrival_time) * 1e9)
        self.span = trace_info.tracer.start_span(
            f"{trace_info.operation} {trace_info.model}".strip(),
            context=trace_info.parent,
            kind=trace.SpanKind.INTERNAL,
            attributes=_request_attributes(trace_info, request),
            start_time=time.time_ns() - waited_ns,
        )
        self.recording = self.span.is_recording()
        self._texts: dict[int, list[str]] = {}
        if self.recording:
            self.span.add_event("queued", {USAGE_INPUT_TOKENS: num_prompt_tokens})
            if self.capture_content and prompt_text is not None:
                message = {"role": "user", "parts": [{"type": "text", "content": prompt_text()}]}
                self.span.set_attribute(INPUT_MESSAGES, json.dumps([message], ensure_ascii=False))

    def scheduled(self, cached_prompt_tokens: int | None) -> None:
        """The request (again, after a preemption) got KV blocks and runs in this step."""
        if self.recording:
            attrs = {} if cached_prompt_tokens is None else {USAGE_CACHE_READ_INPUT_TOKENS: cached_prompt_tokens}
            self.span.add_event("scheduled", attrs)

    def first_token(self) -> None:
        if self.recording:
            self.span.add_event("first_token")

    def preempted(self) -> None:
        """Its blocks were taken for others; it waits to recompute."""
        if self.recording:
            self.span.add_event("preempted")

    def output(self, out: RequestOutput) -> None:
        """Keep completion text, only when content capture is on."""
        if self.recording and self.capture_content:
            for delta in out.deltas:
                self._texts.setdefault(delta.index, []).append(delta.text)

    def shed(self) -> None:
        """Refused while waiting: the queue was full and a shorter-queued tenant took its place."""
        if self.recording:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, "shed from the full waiting queue"))
            self.span.add_event("shed")
        self.span.end()

    def finish(self, stats: RequestStats, finish_reasons: Sequence[FinishReason | None],
               error: Exception | None = None) -> None:
        """Record reasons and usage (and the error a request failed with), then end the span (the
        request is gone from the engine)."""
        if self.recording:
            if error is not None:
                self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            reasons = [str(r) if r is not None else "" for r in finish_reasons]
            self.span.set_attributes(
                {
                    RESPONSE_FINISH_REASONS: reasons,
                    USAGE_INPUT_TOKENS: stats.prompt_tokens,
                    USAGE_OUTPUT_TOKENS: stats.generated_tokens,
                    USAGE_CACHE_READ_INPUT_TOKENS: stats.cached_prompt_tokens,
                }
            )
            if stats.spec_num_drafts:
                self.span.set_attributes(
                    {
                        SPEC_NUM_DRAFTS: stats.spec_num_drafts,
                        SPEC_DRAFT_TOKENS: stats.spec_draft_tokens,
                        SPEC_ACCEPTED_TOKENS: stats.spec_accepted_tokens,
                    }
                )
            if self.capture_content:
                messages = [
                    {
                        "role": "assistant",
                        "parts": [{"type": "text", "content": "".join(self._texts.get(i, []))}],
                        "finish_reason": reason,
                    }
                    for i, reason in enumerate(reasons)
                ]
                self.span.set_attribute(OUTPUT_MESSAGES, json.dumps(messages, ensure_ascii=False))
            self.span.add_event(
                "finished",
                {RESPONSE_FINISH_REASONS: reasons, USAGE_OUTPUT_TOKENS: stats.generated_tokens},
            )
        self.span.end()
