"""RagStore: every owner's documents, chunks and vectors, in partitions chosen by the owner's identity.

The owner is the caller's ``Identity.id`` (hex HMAC-SHA256); its partition is ``int(owner, 16) %
partitions``, so no caller ever names a partition. Layout under ``root``::

    layout.json                   the partition count, fixed once the store exists
    .lock                         flock'd while a store has the root open (one per root)
    partition-<k>/rag.sqlite3     (+ -wal, -shm) documents and chunks, the truth
    partition-<k>/faiss.snapshot  the owners' FAISS indexes at some generation

Quotas hold per owner and per API key (``Identity.quota_id``: every user id under one key shares the
key's quota). An owner's use lives in its partition; a key's owners spread over partitions, so the
store keeps each key's total in memory, summed from the partitions when it opens and moved by every
committed write. A lock per key (striped) makes checking a key's quota and writing one transaction.

Partitions are created on an owner's first write and opened (snapshot loaded or indexes rebuilt) when
the store opens. ``close()`` writes a snapshot, so a clean restart loads in well under a second; after
a crash the snapshot is stale and the indexes are rebuilt from the vectors in SQLite, which for HNSW
means building the graph again (about 45 s per 100k chunks of 384 dimensions on 2 cores). Methods block and are thread-safe (one lock per partition); this module checks every
argument and hands ``partition_store.Partition`` only well-formed input.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from protoserve.server.rag.documents_db import check_limits
from protoserve.server.rag.partition_store import DB_NAME, KeyChanges, Partition, PreparedDocument
from protoserve.server.rag.records import (
    API_KEY,
    ChunkHit,
    ChunkInput,
    DocumentInfo,
    DocumentInput,
    DocumentSize,
    IndexedDocument,
    KeyQuota,
    QuotaExceeded,
    Quotas,
    stored_size,
)
from protoserve.server.rag.vector_index import INDEX_KINDS

try:
    import fcntl
except ImportError:  # not POSIX: no guard against a second process on the same root
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ChunkHit",
    "ChunkInput",
    "DocumentInfo",
    "DocumentInput",
    "DocumentSize",
    "IndexedDocument",
    "QuotaExceeded",
    "Quotas",
    "RagStore",
]

LAYOUT_NAME = "layout.json"
LOCK_NAME = ".lock"
# Identity.id is 64 hex digits; the cap only keeps absurd owners out of every row.
_OWNER = re.compile(r"[0-9a-f]{1,128}")
# Embeddings are normalized in float32; anything further off was never normalized.
UNIT_TOLERANCE = 1e-3
_TOKEN_PREFIX = "rag1:"
# Locks serializing each API key's check-and-write, striped: keys share a lock now and then, which
# costs a wait, never a wrong answer, and the table never grows.
_KEY_LOCKS = 64


class RagStore:
    """The RAG document store: index, search, list, get and delete an owner's documents."""

    def __init__(
        self,
        root: Path,
        *,
        partitions: int,
        dimensions: int,
        index_kind: str = "flat",
        quotas: Quotas = Quotas(),
        key_quotas: Quotas | None = None,
    ) -> None:
        """``quotas`` hold per owner; ``key_quotas`` (None: the same) per API key, over all its owners."""
        _check_count("partitions", partitions)
        _check_count("dimensions", dimensions)
        if index_kind not in INDEX_KINDS:
            raise ValueError(f"index_kind: must be one of {', '.join(INDEX_KINDS)}, got {index_kind!r}")
        key_quotas = quotas if key_quotas is None else key_quotas
        for name, value in (("quotas", quotas), ("key_quotas", key_quotas)):
            if not isinstance(value, Quotas):
                raise ValueError(f"{name}: must be a Quotas, got {type(value).__name__}")
        self._root = Path(root)
        self._count = partitions
        self._dimensions = dimensions
        self._kind = index_kind
        self._quotas = quotas
        self.key_quotas = key_quotas
        self._partitions: dict[int, Partition] = {}
        self._partitions_lock = threading.Lock()
        self._key_use: dict[str, tuple[int, int]] = {}  # quota id -> (documents, stored bytes)
        self._key_use_lock = threading.Lock()
        self._key_locks = [threading.Lock() for _ in range(_KEY_LOCKS)]
        self._closed = False
        self._lock_fd: int | None = None
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_root(self._root)
        try:
            _check_layout(self._root, partitions)
            for k in range(partitions):
                if (self._partition_dir(k) / DB_NAME).exists():
                    self._partitions[k] = self._open_partition(k)
                    self._add_key_use(self._partitions[k].key_usage())
        except BaseException:
            self.close()
            raise

    @property
    def dimensions(self) -> int:
        return self._dimensions

    @property
    def index_kind(self) -> str:
        return self._kind

    @staticmethod
    def partition_of(owner: str, partitions: int) -> int:
        """The partition that holds ``owner``'s data."""
        _check_owner(owner)
        _check_count("partitions", partitions)
        return int(owner, 16) % partitions

    # --- writes ---------------------------------------------------------------------------

    def index(
        self,
        owner: str,
        documents: list[DocumentInput],
        key: str | None = None,
        key_quotas: Quotas | None = None,
    ) -> list[IndexedDocument]:
        """Store ``documents`` (replacing same ids) in one transaction, durable before this returns.

        ``key``: the quota id of the owner's API key (None, or the owner itself: no key quota), whose
        ``key_quotas`` (None: the store's) hold over all its owners. Raises QuotaExceeded, before
        writing anything, when the owner or its key would pass a quota.
        """
        _check_owner(owner)
        key = self._key(owner, key)
        prepared = _prepare_documents(documents, self._dimensions)
        if not prepared:
            return []
        partition = self._partition(owner, create=True)
        if key is None:
            indexed, changes = partition.index(owner, prepared, self._quotas, time.time())
            self._add_key_use(changes)
            return indexed
        with self._key_lock(key):  # the key's total read, checked, written and moved as one
            quota = KeyQuota(key, self.key_use(key), self._key_quotas(key_quotas))
            indexed, changes = partition.index(owner, prepared, self._quotas, time.time(), quota)
            self._add_key_use(changes)
        return indexed

    def check_quotas(
        self,
        owner: str,
        sizes: list[DocumentSize],
        key: str | None = None,
        key_quotas: Quotas | None = None,
    ) -> None:
        """QuotaExceeded if ``index`` of documents of these sizes would pass a quota now; writes nothing.

        For refusing a call before its documents are embedded; ``index`` checks again as it writes.
        """
        _check_owner(owner)
        key = self._key(owner, key)
        for i, size in enumerate(sizes):
            if not isinstance(size, DocumentSize):
                raise ValueError(f"sizes[{i}]: must be a DocumentSize, got {type(size).__name__}")
        quota = None if key is None else KeyQuota(key, self.key_use(key), self._key_quotas(key_quotas))
        partition = self._partition(owner, create=False)
        if partition is not None:
            partition.check_quotas(owner, sizes, self._quotas, quota)
        else:  # the owner's partition does not exist yet: the owner stores nothing so far
            _check_fresh_owner(sizes, self._quotas, quota)

    def key_use(self, key: str) -> tuple[int, int]:
        """(documents, stored bytes) of every owner counted against ``key``."""
        with self._key_use_lock:
            return self._key_use.get(key, (0, 0))

    def delete_documents(self, owner: str, document_ids: list[str]) -> tuple[list[str], list[str]]:
        """(deleted, not_found), each in the order given; a repeated id counts once."""
        _check_owner(owner)
        if not isinstance(document_ids, list | tuple):
            raise ValueError(f"document_ids: must be a list, got {type(document_ids).__name__}")
        for i, document_id in enumerate(document_ids):
            _check_document_id(document_id, f"document_ids[{i}]")
        unique = list(dict.fromkeys(document_ids))
        partition = self._partition(owner, create=False)
        if partition is None:
            return [], unique
        deleted, missing, changes = partition.delete_documents(owner, unique)
        self._add_key_use(changes)
        return deleted, missing

    def _key(self, owner: str, key: str | None) -> str | None:
        if key is None or key == owner:
            return None
        _check_owner(key, "key")
        return key

    def _key_quotas(self, key_quotas: Quotas | None) -> Quotas:
        if key_quotas is None:
            return self.key_quotas
        if not isinstance(key_quotas, Quotas):
            raise ValueError(f"key_quotas: must be a Quotas, got {type(key_quotas).__name__}")
        return key_quotas

    def _key_lock(self, key: str) -> threading.Lock:
        return self._key_locks[hash(key) % _KEY_LOCKS]

    def _add_key_use(self, changes: KeyChanges) -> None:
        with self._key_use_lock:
            for key, (documents, size) in changes.items():
                now = self._key_use.get(key, (0, 0))
                now = (now[0] + documents, now[1] + size)
                if now == (0, 0):
                    self._key_use.pop(key, None)
                else:
                    self._key_use[key] = now

    # --- reads ----------------------------------------------------------------------------

    def search(
        self,
        owner: str,
        vector: np.ndarray,
        top_k: int,
        filter: dict[str, str] | None = None,
        min_score: float | None = None,
    ) -> list[ChunkHit]:
        """The owner's chunks most similar to ``vector``, best first.

        ``filter``: only documents whose metadata holds every pair. ``min_score``: only chunks scoring at
        least that. Exact for "flat" and for any filtered search; "hnsw" without a filter is approximate.
        """
        _check_owner(owner)
        query = _check_vector(vector, self._dimensions, "vector")
        _check_count("top_k", top_k)
        if filter is not None:
            _check_string_map(filter, "filter")
        if min_score is not None and (
            isinstance(min_score, bool)
            or not isinstance(min_score, int | float)
            or not math.isfinite(min_score)
        ):
            raise ValueError(f"min_score: must be a finite number, got {min_score!r}")
        partition = self._partition(owner, create=False)
        if partition is None:
            return []
        return partition.search(owner, query, top_k, dict(filter) if filter else None, min_score)

    def list_documents(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[DocumentInfo], str]:
        """A page of the owner's documents, oldest first, and the token of the next page ("" on the last).

        A replaced document counts as new. ValueError for a token this store did not issue.
        """
        _check_owner(owner)
        _check_count("page_size", page_size)
        after = _decode_token(page_token)
        partition = self._partition(owner, create=False)
        if partition is None:
            return [], ""
        infos, last = partition.list_documents(owner, page_size, after)
        return infos, ("" if last is None else _encode_token(last))

    def get_document(self, owner: str, document_id: str) -> tuple[DocumentInfo, str, list[ChunkHit]] | None:
        """(info, text, chunks in order with score 0), or None when the owner has no such document."""
        _check_owner(owner)
        _check_document_id(document_id, "document_id")
        partition = self._partition(owner, create=False)
        return None if partition is None else partition.get_document(owner, document_id)

    # --- lifecycle ------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Save every partition's indexes that changed since their last snapshot (atomic file replace)."""
        for partition in self._open_partitions():
            partition.snapshot()

    def close(self) -> None:
        """Snapshot and close every partition; the store is unusable afterwards. Idempotent."""
        try:
            for partition in self._open_partitions():
                partition.close()
        finally:
            with self._partitions_lock:
                self._partitions.clear()
                self._closed = True
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def __enter__(self) -> RagStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- partitions -----------------------------------------------------------------------

    def _partition_dir(self, k: int) -> Path:
        return self._root / f"partition-{k}"

    def _open_partition(self, k: int) -> Partition:
        return Partition(self._partition_dir(k), dimensions=self._dimensions, index_kind=self._kind)

    def _open_partitions(self) -> list[Partition]:
        with self._partitions_lock:
            return list(self._partitions.values())

    def _partition(self, owner: str, *, create: bool) -> Partition | None:
        k = int(owner, 16) % self._count
        with self._partitions_lock:
            if self._closed:
                raise RuntimeError("the RAG store is closed")
            partition = self._partitions.get(k)
            if partition is None and create:
                partition = self._partitions[k] = self._open_partition(k)
            return partition


# --- argument checks ------------------------------------------------------------------------


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")


def _check_owner(owner: object, field: str = "owner") -> None:
    if not isinstance(owner, str) or not _OWNER.fullmatch(owner):
        raise ValueError(f"{field}: must be an identity id (1-128 lowercase hex digits)")


def _check_fresh_owner(sizes: list[DocumentSize], quotas: Quotas, key: KeyQuota | None) -> None:
    """check_quotas for an owner with nothing stored (its partition does not exist yet)."""
    after = (len(sizes), sum(s.stored_bytes for s in sizes))
    check_limits((0, 0), after, quotas)
    if key is not None:
        check_limits(key.used, (key.used[0] + after[0], key.used[1] + after[1]), key.quotas, API_KEY)


def _check_document_id(document_id: object, field: str) -> None:
    if not isinstance(document_id, str) or not document_id:
        raise ValueError(f"{field}: must be a non-empty string, got {document_id!r}")


def _check_string_map(value: object, field: str) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: must be a dict of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ValueError(f"{field}: keys and values must be strings, got {key!r}: {item!r}")


def _check_vector(vector: object, dimensions: int, field: str) -> np.ndarray:
    if not isinstance(vector, np.ndarray) or vector.dtype != np.float32:
        kind = vector.dtype if isinstance(vector, np.ndarray) else type(vector).__name__
        raise ValueError(f"{field}: must be a float32 numpy array, got {kind}")
    if vector.shape != (dimensions,):
        raise ValueError(f"{field}: must have shape ({dimensions},), got {vector.shape}")
    if not np.isfinite(vector).all():
        raise ValueError(f"{field}: holds a non-finite value")
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    if abs(norm - 1.0) > UNIT_TOLERANCE:
        raise ValueError(f"{field}: must have unit length, has {norm:.6g}")
    return vector


def _prepare_documents(documents: object, dimensions: int) -> list[PreparedDocument]:
    if not isinstance(documents, list | tuple):
        raise ValueError(f"documents: must be a list, got {type(documents).__name__}")
    seen: set[str] = set()
    prepared = []
    for i, document in enumerate(documents):
        field = f"documents[{i}]"
        if not isinstance(document, DocumentInput):
            raise ValueError(f"{field}: must be a DocumentInput, got {type(document).__name__}")
        _check_document_id(document.document_id, f"{field}.document_id")
        if document.document_id in seen:
            raise ValueError(f"{field}.document_id: {document.document_id!r} appears twice in the call")
        seen.add(document.document_id)
        prepared.append(_prepare_document(document, dimensions, field))
    return prepared


def _prepare_document(document: DocumentInput, dimensions: int, field: str) -> PreparedDocument:
    if not isinstance(document.text, str):
        raise ValueError(f"{field}.text: must be a string, got {type(document.text).__name__}")
    _check_string_map(document.metadata, f"{field}.metadata")
    if not isinstance(document.chunks, list | tuple):
        raise ValueError(f"{field}.chunks: must be a list, got {type(document.chunks).__name__}")
    spans, vectors = [], []
    for j, chunk in enumerate(document.chunks):
        where = f"{field}.chunks[{j}]"
        if not isinstance(chunk, ChunkInput):
            raise ValueError(f"{where}: must be a ChunkInput, got {type(chunk).__name__}")
        for name in ("start", "end"):
            value = getattr(chunk, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}.{name}: must be an integer, got {value!r}")
        if not 0 <= chunk.start <= chunk.end <= len(document.text):
            raise ValueError(
                f"{where}: offsets [{chunk.start}, {chunk.end}) must lie within the text's {len(document.text)} characters"
            )
        if chunk.text != document.text[chunk.start : chunk.end]:
            raise ValueError(f"{where}.text: must be the document's text[{chunk.start}:{chunk.end}]")
        vectors.append(_check_vector(chunk.vector, dimensions, f"{where}.vector"))
        spans.append((chunk.start, chunk.end, chunk.text))
    return PreparedDocument(
        document_id=document.document_id,
        text=document.text,
        metadata=dict(document.metadata),
        bytes=len(document.text.encode("utf-8")),
        stored_bytes=stored_size(document.text, document.metadata, [t for _, _, t in spans], dimensions),
        spans=spans,
        vectors=np.stack(vectors) if vectors else np.empty((0, dimensions), dtype=np.float32),
    )


# --- page tokens ----------------------------------------------------------------------------


def _encode_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"{_TOKEN_PREFIX}{seq}".encode()).decode().rstrip("=")


def _decode_token(token: object) -> int:
    """The seq a page token continues after; 0 for the first page."""
    if not isinstance(token, str):
        raise ValueError(f"page_token: must be a string, got {type(token).__name__}")
    if not token:
        return 0
    try:
        text = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True).decode(
            "ascii"
        )
    except (binascii.Error, UnicodeDecodeError):
        text = ""
    seq = text[len(_TOKEN_PREFIX) :]
    if not text.startswith(_TOKEN_PREFIX) or not seq.isdecimal() or len(seq) > 18:
        raise ValueError("page_token: not a token from a previous page")
    return int(seq)


# --- the root -------------------------------------------------------------------------------


def _lock_root(root: Path) -> int | None:
    """Hold an exclusive lock on ``root``: a second store on it would fork the indexes from SQLite."""
    if fcntl is None:
        return None
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"{root}: another RAG store (this process or another) has it open") from None
    return fd


def _check_layout(root: Path, partitions: int) -> None:
    """Record the partition count on first use and refuse to open with another (owners would move)."""
    path = root / LAYOUT_NAME
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["partitions"]
    except FileNotFoundError:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump({"partitions": partitions}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        return
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if recorded != partitions:
        raise ValueError(
            f"partitions: {root} was created with {recorded} partitions, got {partitions}; "
            "every owner's data would be looked for in the wrong partition"
        )
