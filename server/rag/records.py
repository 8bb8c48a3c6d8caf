"""The document store's plain data: what callers hand it, what it returns, its quotas and their error.

The store never embeds: every chunk arrives with its vector, float32 of the store's dimensions and
unit length, so inner products are cosine similarities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChunkInput:
    """One chunk of a document to index: its character span, its text and its embedding."""

    start: int
    end: int
    text: str  # the document's text[start:end]
    vector: np.ndarray  # float32 [dimensions], unit length


@dataclass(frozen=True)
class DocumentInput:
    """A document to index; the same ``document_id`` again replaces the owner's earlier one."""

    document_id: str
    text: str
    metadata: dict[str, str]
    chunks: list[ChunkInput]


@dataclass(frozen=True)
class IndexedDocument:
    """What indexing did with one document."""

    document_id: str
    chunks: int
    replaced: bool


@dataclass(frozen=True)
class ChunkHit:
    """A stored chunk, as a search finds it (``score`` its cosine similarity) or a get lists it (0)."""

    document_id: str
    chunk_index: int
    start: int
    end: int
    text: str
    score: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class DocumentInfo:
    """A stored document without its text."""

    document_id: str
    metadata: dict[str, str]
    chunks: int
    bytes: int  # UTF-8 bytes of its text
    indexed_at: float  # Unix seconds


@dataclass(frozen=True)
class Quotas:
    """Per-owner limits; 0 means no limit."""

    max_documents: int = 10_000
    max_bytes: int = 256 * 1024 * 1024  # UTF-8 bytes of the documents' texts

    def __post_init__(self) -> None:
        for name in ("max_documents", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"quotas.{name}: must be an integer >= 0 (0 = no limit), got {value!r}")


class QuotaExceeded(Exception):
    """An index call would take its owner past a quota; nothing was written."""

    def __init__(self, quota: str, used: int, requested: int, limit: int) -> None:
        self.quota = quota  # "documents" or "bytes"
        self.used = used  # the owner's use before the call
        self.requested = requested  # the owner's use had the call been accepted
        self.limit = limit
        super().__init__(
            f"{quota} quota exceeded: the owner has {used} {quota}, this call would make it "
            f"{requested}, the limit is {limit}"
        )
