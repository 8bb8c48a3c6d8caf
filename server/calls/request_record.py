"""RequestRecord: one finished request as metrics, usage and the request log see it.

A request is what has one public request id: a Generate or GenerateStream call,
one item of a Batch, one OpenAI completion or chat completion call (however
many prompts and choices it has). A call refused before it got that far (bad
API key, model still loading, invalid OpenAI parameters) is a request too, with
its error status and no tokens.

Its finish reason is one word for the whole request: ``error`` when it failed,
``cancelled`` when it was cancelled (Cancel, the client leaving, its deadline)
or any choice was, else ``length`` when any choice hit its token limit, else
``stop``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from protoserve.engine.api import TEXT_COMPLETION, FinishReason, RequestStats
from protoserve.server import errors

STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"
_CANCEL_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class RequestRecord:
    """What one request did: who asked, what for, what it took, and how it ended."""

    request_id: str
    identity_id: str  # server.security.auth.Identity.id (a keyed hash); "" when the caller could not be identified
    method: str = ""  # the gRPC method it came through, e.g. "/protoserve.v1.InferenceService/Generate"
    operation: str = TEXT_COMPLETION  # gen_ai.operation.name: "chat" or "text_completion"
    model: str = ""  # the model the caller named: an adapter's name, say ("" when it named none)
    served_model: str = ""  # the model that served it ("" until one was chosen)
    started_at: float = field(default_factory=time.time)  # unix seconds
    started: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    choice_finish_reasons: list[str] = field(default_factory=list)
    engine_stats: list[RequestStats] = field(default_factory=list)  # one per engine request that ended
    status: grpc.StatusCode = grpc.StatusCode.OK
    error: str = ""
    duration_s: float = 0.0

    def add_engine_request(
        self,
        prompt_tokens: int,
        output_tokens: int,
        finish_reasons: Sequence[FinishReason | None],
        stats: RequestStats | None,
    ) -> None:
        """Fold in one engine request the request ran (several for multi-prompt completions)."""
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.choice_finish_reasons += [str(r) for r in finish_reasons if r is not None]
        if stats is not None:
            self.cached_prompt_tokens += stats.cached_prompt_tokens
            self.engine_stats.append(stats)

    def finish(self, exc: BaseException | None = None, *, deadline_passed: bool = False) -> None:
        """The request ended, with ``exc`` if it raised; sets the status and duration."""
        self.duration_s = time.monotonic() - self.started
        if exc is None:
            return
        if isinstance(exc, asyncio.CancelledError):
            # gRPC cancels the handler when the client leaves or the deadline passes.
            self.status = grpc.StatusCode.DEADLINE_EXCEEDED if deadline_passed else grpc.StatusCode.CANCELLED
            return
        self.status = errors.status_code(exc)
        self.error = errors.to_service_error(exc).message if self.status != grpc.StatusCode.INTERNAL else ""

    @property
    def finish_reason(self) -> str:
        if self.status in _CANCEL_CODES:
            return CANCELLED
        if self.status != grpc.StatusCode.OK:
            return ERROR
        reasons = set(self.choice_finish_reasons)
        if FinishReason.CANCELLED in reasons:
            return CANCELLED
        if FinishReason.LENGTH in reasons:
            return LENGTH
        return STOP

    def timings(self) -> dict[str, float]:
        """Engine timings in seconds: the earliest first token and queue exit, the longest prefill and decode."""
        stats = self.engine_stats
        started = [s for s in stats if s.generated_tokens]
        return {
            "queue_time_s": min((s.queue_time_s for s in stats), default=0.0),
            "time_to_first_token_s": min((s.time_to_first_token_s for s in started), default=0.0),
            "prefill_time_s": max((s.prefill_time_s for s in stats), default=0.0),
            "decode_time_s": max((s.decode_time_s for s in stats), default=0.0),
            "e2e_time_s": self.duration_s,
        }

    @property
    def model_name(self) -> str:
        """The model the request log names: the one the caller asked for, else the one that served it."""
        return self.model or self.served_model

    def log_fields(self) -> dict:
        """The request log line's fields (no prompt or completion text, no API key)."""
        fields = {
            "event": "request_finished",
            "request_id": self.request_id,
            "identity": self.identity_id,
            "method": self.method,
            "model": self.model_name,
            "operation": self.operation,
            "status": self.status.name,
            "status_code": self.status.value[0],
            "finish_reason": self.finish_reason,
            "choice_finish_reasons": self.choice_finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "started_at": round(self.started_at, 6),
            **{k: round(v, 6) for k, v in self.timings().items()},
        }
        if self.error:
            fields["error"] = self.error
        return fields
