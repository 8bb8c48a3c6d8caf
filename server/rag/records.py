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
    """Limits on what one holder (an owner, or an API key over all its owners) stores; 0 means no limit."""

    max_documents: int = 10_000
    max_bytes: int = 256 * 1024 * 1024  # stored bytes: see stored_size

    def __post_init__(self) -> None:
        for name in ("max_documents", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"quotas.{name}: must be an integer >= 0 (0 = no limit), got {value!r}")


def stored_size(text: str, metadata: dict[str, str], chunk_texts: list[str], dimensions: int) -> int:
    """The bytes a document costs the store, as quotas count them: its text, its metadata, every chunk's
    text (overlaps included) and every chunk's float32 vector.

    Not the text alone: small chunks with a large overlap store the text many times over, and each
    chunk's vector (1,536 bytes at 384 dimensions) can outweigh its text.
    """
    metadata_bytes = sum(len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in metadata.items())
    chunk_bytes = sum(len(t.encode("utf-8")) for t in chunk_texts)
    return len(text.encode("utf-8")) + metadata_bytes + chunk_bytes + 4 * dimensions * len(chunk_texts)


@dataclass(frozen=True)
class DocumentSize:
    """What a document to index will cost, for checking quotas before it is embedded."""

    document_id: str
    stored_bytes: int


OWNER = "owner"
API_KEY = "API key"


@dataclass(frozen=True)
class KeyQuota:
    """An API key's quota as one index call checks it."""

    quota_id: str  # the key's quota id (server.security.auth.Identity.quota_id)
    used: tuple[int, int]  # (documents, stored bytes) of all its owners, every partition, before the call
    quotas: Quotas


class QuotaExceeded(Exception):
    """An index call would take its owner, or the owner's API key, past a quota; nothing was written."""

    def __init__(self, quota: str, used: int, requested: int, limit: int, holder: str = OWNER) -> None:
        self.quota = quota  # "documents" or "bytes" (stored bytes)
        self.used = used  # the holder's use before the call
        self.requested = requested  # the holder's use had the call been accepted
        self.limit = limit
        self.holder = holder  # OWNER or API_KEY (every identity of the key together)
        what = "stored bytes" if quota == "bytes" else quota
        super().__init__(
            f"{quota} quota exceeded: the {holder} has {used} {what}, this call would make it "
            f"{requested}, the limit is {limit}"
        )
