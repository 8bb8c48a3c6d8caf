"""One partition of the document store: a SQLite database and the FAISS indexes of its owners.

SQLite is the truth: documents, their metadata and their chunks with vectors, every row tagged with its
owner's full identity, written in one transaction per call (WAL, synchronous=FULL, so a committed call
survives a crash). A ``generation`` counter in ``meta`` goes up with every writing transaction. The
FAISS indexes (one per owner, keyed by chunk row id) are a cache of the vectors: they are changed only
after the transaction commits, saved to a snapshot file that records the generation it reflects, and
on open loaded from that snapshot only when its generation is SQLite's and its ids match SQLite's;
otherwise (missing, stale after a crash, damaged) they are rebuilt from the vectors in SQLite.

Every method takes the owner and filters by it in SQL (``documents_db`` holds the schema and the
writing statements); one lock per partition serializes its SQLite connection and its indexes.

Quotas are checked inside the writing transaction: the owner's from its ``owners`` row, its API key's
from the use over every partition that the store passes in (records.KeyQuota). The writes report how
each key's use changed, for the store to keep its totals.
"""

from __future__ import annotations

import itertools
import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from protoserve.server.rag.documents_db import (
    DB_NAME,
    OwnerUsage,
    PreparedDocument,
    Transaction,
    add_documents,
    bump_generation,
    check_limits,
    hit_from_row,
    key_usage,
    open_database,
    owner_usage,
    remove_documents,
    replaced_sizes,
    select_in,
    set_quota_id,
)
from protoserve.server.rag.records import (
    API_KEY,
    ChunkHit,
    DocumentInfo,
    DocumentSize,
    IndexedDocument,
    KeyQuota,
    Quotas,
)
from protoserve.server.rag.snapshot import (
    Snapshot,
    SnapshotError,
    fsync_directory,
    read_snapshot,
    write_snapshot,
)
from protoserve.server.rag.vector_index import OwnerIndex

log = logging.getLogger(__name__)

SNAPSHOT_NAME = "faiss.snapshot"
# How a write changed API keys' use: {quota id: (documents, stored bytes)}, either may be negative.
KeyChanges = dict[str, tuple[int, int]]


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _minus(a: tuple[int, int]) -> tuple[int, int]:
    return -a[0], -a[1]


def _checked(
    usage: OwnerUsage,
    change: tuple[int, int],
    quotas: Quotas,
    key: KeyQuota | None,
) -> KeyChanges:
    """Check the owner's and its key's quotas for a call that changes the owner's use by ``change``;
    how the call changes each key's use. QuotaExceeded, naming the holder, if it passes one."""
    before = (usage.documents, usage.bytes)
    check_limits(before, _plus(before, change), quotas)
    if key is None:
        return {usage.quota_id: change} if usage.quota_id is not None else {}
    # An owner not yet counted against this key (stored before keys were counted) joins it whole.
    joining = usage.quota_id != key.quota_id
    key_before = _plus(key.used, before) if joining else key.used
    check_limits(key_before, _plus(key_before, change), key.quotas, API_KEY)
    changes = {key.quota_id: _plus(before, change) if joining else change}
    if joining and usage.quota_id is not None:
        changes[usage.quota_id] = _minus(before)
    return changes


class Partition:
    """A partition directory: ``rag.sqlite3`` (+ WAL) and ``faiss.snapshot``."""

    def __init__(self, directory: Path, *, dimensions: int, index_kind: str) -> None:
        self.directory = directory
        self.name = directory.name
        self._dimensions = dimensions
        self._kind = index_kind
        self._lock = threading.RLock()
        self._snapshot_lock = threading.Lock()
        self._indexes: dict[str, OwnerIndex] = {}
        self._snapshot_generation: int | None = None
        if not directory.exists():
            directory.mkdir(parents=True)
            fsync_directory(directory.parent)  # the new partition's entry outlives a power cut
        opened = open_database(directory / DB_NAME, dimensions)
        self._db: sqlite3.Connection | None = opened.connection
        self._generation = opened.generation
        self._database_id = opened.database_id
        try:
            self._load_indexes()
        except BaseException:
            self._db.close()
            raise

    # --- opening and recovery -------------------------------------------------------------

    def _load_indexes(self) -> None:
        path = self.directory / SNAPSHOT_NAME
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)  # a snapshot write a crash cut short
        live = self._live_ids()
        try:
            snapshot = read_snapshot(path)
            reason = self._unusable(snapshot)
            if reason is None:
                assert snapshot is not None
                self._indexes = self._indexes_from(snapshot, live)
                self._snapshot_generation = snapshot.generation
                return
            if snapshot is not None:
                log.info(
                    "RAG %s: FAISS snapshot is %s; rebuilding the indexes from SQLite", self.name, reason
                )
        except SnapshotError as e:
            log.warning(
                "RAG %s: FAISS snapshot %s is damaged (%s); rebuilding the indexes from SQLite",
                self.name,
                path,
                e,
            )
        self._indexes = self._rebuild_all()
        self.snapshot()

    def _unusable(self, snapshot: Snapshot | None) -> str | None:
        if snapshot is None:
            return "missing"
        if snapshot.generation != self._generation:
            return f"at generation {snapshot.generation}, SQLite at {self._generation}"
        if snapshot.index_kind != self._kind or snapshot.dimensions != self._dimensions:
            return f"{snapshot.index_kind} of {snapshot.dimensions} dimensions, not {self._kind} of {self._dimensions}"
        return None

    def _indexes_from(self, snapshot: Snapshot, live: dict[str, np.ndarray]) -> dict[str, OwnerIndex]:
        if snapshot.database_id != self._database_id:
            raise SnapshotError("it was made from another database")
        if set(snapshot.indexes) != set(live):
            raise SnapshotError("its owners differ from SQLite's")
        indexes = {}
        for owner, data in snapshot.indexes.items():
            try:
                indexes[owner] = OwnerIndex.from_bytes(self._kind, self._dimensions, data, live[owner])
            except ValueError as e:
                raise SnapshotError(str(e)) from None
        return indexes

    def _live_ids(self) -> dict[str, np.ndarray]:
        rows = self._conn().execute("SELECT owner, id FROM chunks ORDER BY owner, id")
        return {
            owner: np.fromiter((chunk_id for _, chunk_id in group), dtype=np.int64)
            for owner, group in itertools.groupby(rows, key=lambda row: row[0])
        }

    def _rebuild_all(self) -> dict[str, OwnerIndex]:
        rows = self._conn().execute("SELECT owner, id, vector FROM chunks ORDER BY owner, id")
        return {
            owner: self._build(owner, ((chunk_id, vector) for _, chunk_id, vector in group))
            for owner, group in itertools.groupby(rows, key=lambda row: row[0])
        }

    def _rebuild_owner(self, owner: str) -> None:
        rows = list(
            self._conn().execute("SELECT id, vector FROM chunks WHERE owner = ? ORDER BY id", (owner,))
        )
        if rows:
            self._indexes[owner] = self._build(owner, rows)
        else:
            self._indexes.pop(owner, None)

    def _build(self, owner: str, rows: Iterable[tuple[int, bytes]]) -> OwnerIndex:
        ids, blobs = [], []
        expected = 4 * self._dimensions
        for chunk_id, vector in rows:
            if len(vector) != expected:
                raise ValueError(
                    f"{self.directory / DB_NAME}: chunk {chunk_id} has a {len(vector)}-byte vector, expected {expected}"
                )
            ids.append(chunk_id)
            blobs.append(vector)
        vectors = np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(ids), self._dimensions)
        return OwnerIndex.build(self._kind, self._dimensions, np.asarray(ids, dtype=np.int64), vectors)

    # --- SQLite plumbing ------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the RAG store is closed")
        return self._db

    def _transaction(self) -> Transaction:
        return Transaction(self._conn())

    # --- operations -----------------------------------------------------------------------

    def index(
        self,
        owner: str,
        documents: Sequence[PreparedDocument],
        quotas: Quotas,
        now: float,
        key: KeyQuota | None = None,
    ) -> tuple[list[IndexedDocument], KeyChanges]:
        with self._lock:
            db = self._conn()
            with self._transaction():
                usage = owner_usage(db, owner)
                existing = replaced_sizes(db, owner, [d.document_id for d in documents])
                change = (
                    len(documents) - len(existing),
                    sum(d.stored_bytes for d in documents) - sum(size for _, size in existing.values()),
                )
                changes = _checked(usage, change, quotas, key)
                removed = remove_documents(db, owner, list(existing.values()))
                added = add_documents(db, owner, documents, now)
                if key is not None and usage.quota_id != key.quota_id:
                    set_quota_id(db, owner, key.quota_id)
                bump_generation(db)
            self._generation += 1
            vectors = np.concatenate([d.vectors for d in documents]) if documents else None
            self._apply(
                owner, np.asarray(removed, dtype=np.int64), np.asarray(added, dtype=np.int64), vectors
            )
        indexed = [IndexedDocument(d.document_id, len(d.spans), d.document_id in existing) for d in documents]
        return indexed, changes

    def check_quotas(
        self, owner: str, sizes: Sequence[DocumentSize], quotas: Quotas, key: KeyQuota | None = None
    ) -> None:
        """QuotaExceeded if indexing documents of these sizes now would pass a quota; writes nothing."""
        with self._lock:
            db = self._conn()
            usage = owner_usage(db, owner)
            existing = replaced_sizes(db, owner, [s.document_id for s in sizes])
        change = (
            len(sizes) - len(existing),
            sum(s.stored_bytes for s in sizes) - sum(size for _, size in existing.values()),
        )
        _checked(usage, change, quotas, key)

    def key_usage(self) -> KeyChanges:
        """{quota id: (documents, stored bytes)} of this partition's owners that count against a key."""
        with self._lock:
            return key_usage(self._conn())

    def _apply(self, owner: str, removed: np.ndarray, added: np.ndarray, vectors: np.ndarray | None) -> None:
        """Bring the owner's index in step with a committed transaction."""
        try:
            index = self._indexes.get(owner)
            if index is not None:
                index.remove(removed)
            if len(added):
                if index is None:
                    index = self._indexes[owner] = OwnerIndex(self._kind, self._dimensions)
                index.add(added, vectors)
            if index is not None and index.live_count == 0:
                del self._indexes[owner]
        except Exception as e:  # SQLite has committed: never leave the index out of step with it
            log.warning("RAG %s: updating an index failed (%s); rebuilding it from SQLite", self.name, e)
            self._rebuild_owner(owner)

    def search(
        self,
        owner: str,
        query: np.ndarray,
        top_k: int,
        filter: dict[str, str] | None,
        min_score: float | None,
    ) -> list[ChunkHit]:
        with self._lock:
            index = self._indexes.get(owner)
            if index is None:
                return []
            candidates = self._matching_chunks(owner, filter) if filter else None
            scores, ids = index.search(query, top_k, candidates)
            if min_score is not None:
                keep = scores >= min_score
                scores, ids = scores[keep], ids[keep]
            rows = {
                row[0]: row
                for row in select_in(
                    self._conn(),
                    "SELECT c.id, d.document_id, c.chunk_index, c.start_offset, c.end_offset, c.text, d.metadata"
                    " FROM chunks c JOIN documents d ON d.id = c.document"
                    # "+owner": the ids pick the rows; the owner filter must not pick the index.
                    " WHERE c.id IN ({}) AND +c.owner = ? AND +d.owner = ?",
                    (),
                    ids.tolist(),
                    (owner, owner),
                )
            }
        return [
            hit_from_row(rows[chunk_id], float(score))
            for score, chunk_id in zip(scores.tolist(), ids.tolist(), strict=True)
            if chunk_id in rows
        ]

    def _matching_chunks(self, owner: str, filter: dict[str, str]) -> np.ndarray:
        pairs = sorted(filter.items())
        documents = " INTERSECT ".join(
            "SELECT document FROM document_metadata WHERE owner = ? AND key = ? AND value = ?" for _ in pairs
        )
        params = [owner] + [v for key, value in pairs for v in (owner, key, value)]
        rows = self._conn().execute(
            f"SELECT id FROM chunks WHERE owner = ? AND document IN ({documents})", params
        )
        return np.fromiter((row[0] for row in rows), dtype=np.int64)

    def list_documents(
        self, owner: str, page_size: int, after_seq: int
    ) -> tuple[list[DocumentInfo], int | None]:
        """A page of documents after ``after_seq``, and the seq to continue after (None on the last page)."""
        with self._lock:
            rows = (
                self._conn()
                .execute(
                    "SELECT seq, document_id, metadata, chunk_count, bytes, indexed_at FROM documents"
                    " WHERE owner = ? AND seq > ? ORDER BY seq LIMIT ?",
                    (owner, after_seq, page_size + 1),
                )
                .fetchall()
            )
        more = len(rows) > page_size
        rows = rows[:page_size]
        infos = [DocumentInfo(r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in rows]
        return infos, (rows[-1][0] if more else None)

    def get_document(self, owner: str, document_id: str) -> tuple[DocumentInfo, str, list[ChunkHit]] | None:
        with self._lock:
            db = self._conn()
            row = db.execute(
                "SELECT id, document_id, metadata, chunk_count, bytes, indexed_at, text FROM documents"
                " WHERE owner = ? AND document_id = ?",
                (owner, document_id),
            ).fetchone()
            if row is None:
                return None
            chunks = db.execute(
                "SELECT id, ?, chunk_index, start_offset, end_offset, text, ? FROM chunks"
                " WHERE owner = ? AND document = ? ORDER BY chunk_index",
                (row[1], row[2], owner, row[0]),
            ).fetchall()
        info = DocumentInfo(row[1], json.loads(row[2]), row[3], row[4], row[5])
        return info, row[6], [hit_from_row(chunk, 0.0) for chunk in chunks]

    def delete_documents(
        self, owner: str, document_ids: Sequence[str]
    ) -> tuple[list[str], list[str], KeyChanges]:
        with self._lock:
            db = self._conn()
            with self._transaction():
                quota_id = owner_usage(db, owner).quota_id
                found = replaced_sizes(db, owner, document_ids)
                removed = remove_documents(db, owner, list(found.values()))
                if found:
                    bump_generation(db)
            if found:
                self._generation += 1
                self._apply(owner, np.asarray(removed, dtype=np.int64), np.empty(0, np.int64), None)
        freed = (len(found), sum(size for _, size in found.values()))
        changes = {quota_id: _minus(freed)} if quota_id is not None and found else {}
        deleted = [d for d in document_ids if d in found]
        return deleted, [d for d in document_ids if d not in found], changes

    def snapshot(self) -> None:
        """Write the indexes to the snapshot file unless it already reflects this generation."""
        with self._snapshot_lock:
            self._write_snapshot()

    def _write_snapshot(self) -> None:
        # The caller holds _snapshot_lock (always taken before _lock): one writer of the file at a time,
        # and never an older snapshot replacing a newer one.
        with self._lock:
            if self._db is None or self._snapshot_generation == self._generation:
                return
            snapshot = Snapshot(
                self._database_id,
                self._generation,
                self._kind,
                self._dimensions,
                {owner: index.to_bytes() for owner, index in sorted(self._indexes.items())},
            )
        # Written outside _lock: searches and writes go on meanwhile.
        write_snapshot(self.directory / SNAPSHOT_NAME, snapshot)
        self._snapshot_generation = snapshot.generation

    def close(self) -> None:
        with self._snapshot_lock, self._lock:
            if self._db is None:
                return
            try:
                self._write_snapshot()
            finally:
                self._db.close()
                self._db = None
                self._indexes = {}

    @property
    def generation(self) -> int:
        return self._generation
