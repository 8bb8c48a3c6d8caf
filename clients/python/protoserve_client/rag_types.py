"""Typed results of the embedding and RAG calls, converted from the protobuf messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from protoserve_client._stubs import embeddings_pb2 as epb
from protoserve_client._stubs import rag_pb2 as rpb
from protoserve_client.types import FinishReason, Usage


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
