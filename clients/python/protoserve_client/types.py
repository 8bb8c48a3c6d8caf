"""Plain typed results the clients return, converted from the protobuf messages.

Every result keeps the message it came from in ``raw`` so nothing the server
sends is lost when a field is added to the proto before it is added here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypedDict, cast

from google.protobuf import json_format

from protoserve_client._stubs import agent_pb2 as apb
from protoserve_client._stubs import embeddings_pb2 as epb
from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client._stubs import rag_pb2 as rpb


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

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        """Convert a ``protoserve.v1.ModelInfo``; field names match one to one."""
        return cls(**{name: getattr(msg, name) for name in cls.__dataclass_fields__})


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


# --- embeddings ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """One unit-length vector per input, in input order, from the server's embedding model."""

    vectors: list[list[float]]
    dimensions: int
    model: str
    prompt_tokens: int
    raw: epb.EmbedResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: epb.EmbedResponse) -> EmbedResult:
        """Convert a ``protoserve.v1.EmbedResponse``; vectors are ordered by their ``index``."""
        ordered = sorted(msg.embeddings, key=lambda e: e.index)
        return cls(
            vectors=[list(e.values) for e in ordered],
            dimensions=msg.dimensions,
            model=msg.model,
            prompt_tokens=msg.usage.prompt_tokens,
            raw=msg,
        )


# --- RAG ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Document:
    """A document to index; plain ``{"document_id", "text"[, "metadata"]}`` dicts work too."""

    document_id: str
    text: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class IndexedDocument:
    """What indexing did with one document."""

    document_id: str
    chunks: int
    tokens: int
    replaced: bool

    @classmethod
    def from_proto(cls, msg: rpb.IndexedDocument) -> IndexedDocument:
        """Convert a ``protoserve.v1.IndexedDocument``; field names match one to one."""
        return cls(**{name: getattr(msg, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class ChunkHit:
    """A chunk of a document: ``text`` is the document's ``text[start:end]``; ``score`` is the cosine to the query."""

    document_id: str
    chunk_index: int
    start: int
    end: int
    text: str
    score: float
    metadata: dict[str, str]

    @classmethod
    def from_proto(cls, msg: rpb.ChunkHit) -> ChunkHit:
        """Convert a ``protoserve.v1.ChunkHit``."""
        return cls(
            document_id=msg.document_id,
            chunk_index=msg.chunk_index,
            start=msg.start,
            end=msg.end,
            text=msg.text,
            score=msg.score,
            metadata=dict(msg.metadata),
        )


@dataclass(frozen=True, slots=True)
class DocumentInfo:
    """A stored document without its text: chunk count, UTF-8 size and when it was indexed (Unix seconds)."""

    document_id: str
    metadata: dict[str, str]
    chunks: int
    bytes: int
    indexed_at: float

    @classmethod
    def from_proto(cls, msg: rpb.DocumentInfo) -> DocumentInfo:
        """Convert a ``protoserve.v1.DocumentInfo``."""
        return cls(
            document_id=msg.document_id,
            metadata=dict(msg.metadata),
            chunks=msg.chunks,
            bytes=msg.bytes,
            indexed_at=msg.indexed_at,
        )


@dataclass(frozen=True, slots=True)
class DocumentPage:
    """One page of the caller's documents, oldest first; ``next_page_token`` is empty on the last page."""

    documents: list[DocumentInfo]
    next_page_token: str

    @classmethod
    def from_proto(cls, msg: rpb.ListDocumentsResponse) -> DocumentPage:
        """Convert a ``protoserve.v1.ListDocumentsResponse``."""
        return cls([DocumentInfo.from_proto(d) for d in msg.documents], msg.next_page_token)


@dataclass(frozen=True, slots=True)
class StoredDocument:
    """One stored document: what is known about it, its text and its chunks (score 0)."""

    info: DocumentInfo
    text: str
    chunks: list[ChunkHit]

    @property
    def document_id(self) -> str:
        """The document's id."""
        return self.info.document_id

    @property
    def metadata(self) -> dict[str, str]:
        """The document's metadata."""
        return self.info.metadata

    @classmethod
    def from_proto(cls, msg: rpb.GetDocumentResponse) -> StoredDocument:
        """Convert a ``protoserve.v1.GetDocumentResponse``."""
        return cls(
            info=DocumentInfo.from_proto(msg.document),
            text=msg.text,
            chunks=[ChunkHit.from_proto(c) for c in msg.chunks],
        )


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """Ids that were removed, and ids the caller had no document for."""

    deleted: list[str]
    not_found: list[str]


@dataclass(frozen=True, slots=True)
class Citation:
    """A chunk the answer was given, numbered as the prompt numbers it (``[1]`` is ``number == 1``)."""

    number: int
    chunk: ChunkHit

    @classmethod
    def from_proto(cls, msg: rpb.Citation) -> Citation:
        """Convert a ``protoserve.v1.Citation``."""
        return cls(number=msg.number, chunk=ChunkHit.from_proto(msg.chunk))


@dataclass(frozen=True, slots=True)
class RagAnswer:
    """A question answered from the caller's documents, with the chunks the model was given."""

    answer: str
    citations: list[Citation]
    finish_reason: FinishReason
    usage: Usage
    request_id: str
    model: str
    raw: rpb.RetrieveAndGenerateResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: rpb.RetrieveAndGenerateResponse) -> RagAnswer:
        """Convert a ``protoserve.v1.RetrieveAndGenerateResponse``."""
        return cls(
            answer=msg.answer,
            citations=[Citation.from_proto(c) for c in msg.citations],
            finish_reason=FinishReason.from_proto(msg.finish_reason),
            usage=Usage.from_proto(msg.usage),
            request_id=msg.request_id,
            model=msg.model,
            raw=msg,
        )


@dataclass(frozen=True, slots=True)
class RagCitations:
    """The first event of a streamed answer: the chunks the model is given."""

    request_id: str
    citations: list[Citation]


@dataclass(frozen=True, slots=True)
class RagDelta:
    """New answer text."""

    request_id: str
    text: str


@dataclass(frozen=True, slots=True)
class RagFinal:
    """The last event of a streamed answer: why it ended and its tokens."""

    request_id: str
    model: str
    finish_reason: FinishReason
    usage: Usage


RagStreamEvent = RagCitations | RagDelta | RagFinal
"""What a streamed answer yields: one ``RagCitations``, any number of ``RagDelta``, then one ``RagFinal``."""


def rag_stream_event_from_proto(msg: rpb.RetrieveAndGenerateStreamResponse) -> RagStreamEvent:
    """Convert one ``protoserve.v1.RetrieveAndGenerateStreamResponse``."""
    kind = msg.WhichOneof("event")
    if kind == "citations":
        return RagCitations(msg.request_id, [Citation.from_proto(c) for c in msg.citations.citations])
    if kind == "text":
        return RagDelta(msg.request_id, msg.text)
    if kind == "final":
        f = msg.final
        return RagFinal(
            request_id=msg.request_id,
            model=f.model,
            finish_reason=FinishReason.from_proto(f.finish_reason),
            usage=Usage.from_proto(f.usage),
        )
    raise ValueError(f"RAG stream message for {msg.request_id!r} carries no event")


# --- agent --------------------------------------------------------------------


class AgentStopReason(StrEnum):
    """Why an agent run ended (``AgentStopReason`` in the proto, without its prefix)."""

    UNSPECIFIED = "unspecified"
    ANSWERED = "answered"
    MAX_STEPS = "max_steps"
    LENGTH = "length"

    @classmethod
    def from_proto(cls, value: int) -> AgentStopReason:
        """Map a ``protoserve.v1.AgentStopReason`` number to its member."""
        return cls(apb.AgentStopReason.Name(value).removeprefix("AGENT_STOP_REASON_").lower())


@dataclass(frozen=True, slots=True)
class AgentEventBase:
    """What every agent event carries.

    ``step`` counts model steps from 1; ``elapsed_s`` is the time since the run
    started; ``duration_s`` is the model step's time (the tool call's, for a
    ``AgentToolResult``); ``usage`` is the model step's tokens, set only on the
    step's first event.
    """

    run_id: str
    step: int
    elapsed_s: float
    duration_s: float
    usage: Usage | None


@dataclass(frozen=True, slots=True)
class AgentThought(AgentEventBase):
    """Text the model wrote in a step before calling tools."""

    content: str


@dataclass(frozen=True, slots=True)
class AgentToolCall(AgentEventBase):
    """A tool call the model made, sent when the tool starts; ``arguments`` is a string of JSON."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class AgentToolResult(AgentEventBase):
    """What a tool call returned (or its error, with ``is_error``), as the model reads it next step."""

    id: str
    name: str
    content: str
    is_error: bool


@dataclass(frozen=True, slots=True)
class AgentAnswer(AgentEventBase):
    """The run's last event: the answer, why the run ended, its steps and the tokens of every step."""

    content: str
    stop_reason: AgentStopReason
    steps: int
    run_usage: Usage


AgentEvent = AgentThought | AgentToolCall | AgentToolResult | AgentAnswer
"""What ``run_agent`` yields; the last event is always an ``AgentAnswer``."""


def agent_event_from_proto(msg: apb.RunAgentResponse) -> AgentEvent:
    """Convert one ``protoserve.v1.RunAgentResponse``."""
    common: dict[str, Any] = {
        "run_id": msg.run_id,
        "step": msg.step,
        "elapsed_s": msg.elapsed_s,
        "duration_s": msg.duration_s,
        "usage": Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
    }
    kind = msg.WhichOneof("event")
    if kind == "thought":
        return AgentThought(**common, content=msg.thought.content)
    if kind == "tool_call":
        c = msg.tool_call
        return AgentToolCall(**common, id=c.id, name=c.name, arguments=c.arguments)
    if kind == "tool_result":
        r = msg.tool_result
        return AgentToolResult(**common, id=r.id, name=r.name, content=r.content, is_error=r.is_error)
    if kind == "answer":
        a = msg.answer
        return AgentAnswer(
            **common,
            content=a.content,
            stop_reason=AgentStopReason.from_proto(a.stop_reason),
            steps=a.steps,
            run_usage=Usage.from_proto(a.usage),
        )
    raise ValueError(f"agent run {msg.run_id!r} sent an event of no known kind")


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """A tool an agent run may use: its name, description and the JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_proto(cls, msg: apb.ToolInfo) -> ToolInfo:
        """Convert a ``protoserve.v1.ToolInfo``; the schema becomes plain JSON data."""
        return cls(msg.name, msg.description, json_format.MessageToDict(msg.parameters))
