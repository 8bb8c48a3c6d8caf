"""Plain typed results the clients return, converted from the protobuf messages.

Every result keeps the message it came from in ``raw`` so nothing the server
sends is lost when a field is added to the proto before it is added here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypedDict, cast

from protoserve_client._stubs import inference_pb2 as pb


class FinishReason(StrEnum):
    """Why a choice ended (``FinishReason`` in the proto, without its prefix)."""

    UNSPECIFIED = "unspecified"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        """Map a ``protoserve.v1.FinishReason`` number to its member."""
        name = pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
        return cls(name)


class ContextPolicy(StrEnum):
    """What the server does when prompt plus ``max_tokens`` exceeds the context window."""

    UNSPECIFIED = "unspecified"
    ALLOW_CONTEXT_STOP = "allow_context_stop"
    REJECT = "reject"
    TRUNCATE_LEFT = "truncate_left"
    TRUNCATE_RIGHT = "truncate_right"
    RESERVE_GENERATION = "reserve_generation"

    def to_proto(self) -> pb.ContextPolicy:
        """The ``protoserve.v1.ContextPolicy`` number of this member."""
        return cast(pb.ContextPolicy, pb.ContextPolicy.Value("CONTEXT_POLICY_" + self.value.upper()))


class AnswerSamplingKwargs(TypedDict, total=False):
    """``SamplingKwargs`` without ``top_k``: ``retrieve_and_generate`` spends ``top_k`` on the chunk count.

    Those methods take sampling's own top-k as ``sampling_top_k``.
    """

    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    min_p: float
    top_n_sigma: float
    typical_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: Mapping[int, float]
    seed: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    n: int
    logprobs: bool
    top_logprobs: int
    skip_special_tokens: bool
    constraint: pb.Constraint  # e.g. pb.Constraint(regex="[0-9]+"); see inference.proto
    mirostat_mode: int
    mirostat_tau: float
    mirostat_eta: float
    xtc_probability: float
    xtc_threshold: float


class SamplingKwargs(AnswerSamplingKwargs, total=False):
    """Keyword arguments that fill ``protoserve.v1.SamplingParams``; unset means the server default.

    The meaning and defaults of each field are documented in ``inference.proto``.
    """

    top_k: int


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat conversation; plain ``{"role": ..., "content": ...}`` dicts work too."""

    role: str
    content: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log probability of one token."""

    token_id: int
    token: str
    logprob: float

    @classmethod
    def from_proto(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        """Convert a ``protoserve.v1.TokenLogprob``."""
        return cls(token_id=msg.token_id, token=msg.token, logprob=msg.logprob)


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """The chosen token's log probability and the most likely alternatives at that position."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]

    @classmethod
    def from_proto(cls, msg: pb.PositionLogprobs) -> PositionLogprobs:
        """Convert a ``protoserve.v1.PositionLogprobs``."""
        return cls(
            chosen=TokenLogprob.from_proto(msg.chosen),
            top=tuple(TokenLogprob.from_proto(t) for t in msg.top),
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_prompt_tokens: int = 0

    @classmethod
    def from_proto(cls, msg: pb.Usage) -> Usage:
        """Convert a ``protoserve.v1.Usage``."""
        return cls(
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
            total_tokens=msg.total_tokens,
            cached_prompt_tokens=msg.cached_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Where a request's time went and what it held (seconds, tokens, KV blocks)."""

    queue_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    e2e_time_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    kv_blocks: int = 0
    kv_bytes: int = 0
    preemptions: int = 0
    truncated_prompt_tokens: int = 0

    @classmethod
    def from_proto(cls, msg: pb.RequestStats) -> RequestStats:
        """Convert a ``protoserve.v1.RequestStats``; field names match one to one."""
        return cls(**{name: getattr(msg, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a generation."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stop_reason: str = ""
    logprobs: tuple[PositionLogprobs, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.Choice) -> Choice:
        """Convert a ``protoserve.v1.Choice``."""
        return cls(
            index=msg.index,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            finish_reason=FinishReason.from_proto(msg.finish_reason),
            stop_reason=msg.stop_reason,
            logprobs=tuple(PositionLogprobs.from_proto(p) for p in msg.logprobs),
        )


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished generation: every choice, token counts and timings."""

    request_id: str
    model: str
    choices: tuple[Choice, ...]
    usage: Usage
    stats: RequestStats
    raw: pb.GenerateResponse = field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """Text of the first choice, the common case of ``n == 1``."""
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> FinishReason:
        """Finish reason of the first choice."""
        return self.choices[0].finish_reason if self.choices else FinishReason.UNSPECIFIED

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> GenerateResult:
        """Convert a ``protoserve.v1.GenerateResponse``."""
        return cls(
            request_id=msg.request_id,
            model=msg.model,
            choices=tuple(Choice.from_proto(c) for c in msg.choices),
            usage=Usage.from_proto(msg.usage),
            stats=RequestStats.from_proto(msg.stats),
            raw=msg,
        )


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """New output of one choice, as soon as the server has it."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class ChoiceFinish:
    """How one streamed choice ended."""

    index: int
    finish_reason: FinishReason
    stop_reason: str = ""


@dataclass(frozen=True, slots=True)
class StreamFinal:
    """The last event of a stream: finish reasons, token counts and timings."""

    request_id: str
    model: str
    choices: tuple[ChoiceFinish, ...]
    usage: Usage
    stats: RequestStats

    @property
    def finish_reason(self) -> FinishReason:
        """Finish reason of the first choice."""
        return self.choices[0].finish_reason if self.choices else FinishReason.UNSPECIFIED


StreamEvent = StreamDelta | StreamFinal
"""What a stream yields: any number of deltas, then exactly one final."""


def stream_event_from_proto(msg: pb.GenerateStreamResponse) -> StreamEvent:
    """Convert one ``protoserve.v1.GenerateStreamResponse`` into a delta or the final."""
    kind = msg.WhichOneof("event")
    if kind == "delta":
        d = msg.delta
        return StreamDelta(
            request_id=msg.request_id,
            index=d.index,
            text=d.text,
            token_ids=tuple(d.token_ids),
            logprobs=tuple(PositionLogprobs.from_proto(p) for p in d.logprobs),
        )
    if kind == "final":
        f = msg.final
        return StreamFinal(
            request_id=msg.request_id,
            model=f.model,
            choices=tuple(
                ChoiceFinish(
                    index=c.index,
                    finish_reason=FinishReason.from_proto(c.finish_reason),
                    stop_reason=c.stop_reason,
                )
                for c in f.choices
            ),
            usage=Usage.from_proto(f.usage),
            stats=RequestStats.from_proto(f.stats),
        )
    # A message with neither is a server bug; failing loudly beats yielding nothing.
    raise ValueError(f"stream message for {msg.request_id!r} carries neither a delta nor a final")


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """Token ids of a text or conversation, their text pieces and the model's context window."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    max_model_len: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model the server has loaded."""

    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    quantization: str
    num_parameters: int
    has_chat_template: bool
    source: str
    kind: str  # "chat", "completion" or "embedding"
    aliases: tuple[str, ...]  # other names a request may use for the model
    kv_bytes_per_token: int  # bytes one token takes in the paged KV pool

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        """Convert a ``protoserve.v1.ModelInfo``; field names match one to one."""
        fields = {name: getattr(msg, name) for name in cls.__dataclass_fields__}
        return cls(**fields | {"aliases": tuple(msg.aliases)})


@dataclass(frozen=True, slots=True)
class Health:
    """Whether the server takes traffic, and which models it serves."""

    serving: bool
    status: str
    models: tuple[str, ...]

    @classmethod
    def from_proto(cls, msg: pb.CheckHealthResponse) -> Health:
        """Convert a ``protoserve.v1.CheckHealthResponse``."""
        return cls(
            serving=msg.status == pb.SERVING_STATUS_SERVING,
            status=pb.ServingStatus.Name(msg.status).removeprefix("SERVING_STATUS_").lower(),
            models=tuple(msg.models),
        )
