"""A partition's SQLite database: its schema and the statements the partition runs.

Every table row carries its owner's full identity and every statement filters by it. ``chunks.id``
(AUTOINCREMENT, so never reused) is the chunk's FAISS id. ``meta`` holds the schema version, the vector
dimensions, a random database id and the ``generation``, which every writing transaction raises.

``owners`` keeps each owner's use (documents, stored bytes: records.stored_size) and its quota id, the
API key whose quota it also counts against (NULL when that is the owner itself); the store sums the
owners of a key over every partition when it opens. Schema 1 counted only text bytes and knew no
quota ids: opening such a database migrates it in one transaction (see _migrate_1_to_2).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protoserve.server.rag.records import OWNER, ChunkHit, QuotaExceeded, Quotas

DB_NAME = "rag.sqlite3"
SCHEMA_VERSION = 2
# Stays under SQLite's limit on bound parameters per statement.
_IN_BATCH = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS owners (
    owner TEXT PRIMARY KEY,
    next_seq INTEGER NOT NULL,  -- orders the owner's documents for listing; never reused
    documents INTEGER NOT NULL,  -- the owner's use, kept by the transactions that change it (quotas)
    bytes INTEGER NOT NULL,  -- stored bytes (records.stored_size)
    quota_id TEXT  -- the API key's quota id the owner also counts against; NULL: none but its own
);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL REFERENCES owners(owner),
    seq INTEGER NOT NULL,
    document_id TEXT NOT NULL,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL,  -- JSON object of strings
    bytes INTEGER NOT NULL,  -- UTF-8 bytes of the text
    chunk_count INTEGER NOT NULL,
    indexed_at REAL NOT NULL,
    stored_bytes INTEGER NOT NULL,  -- what it costs its owner's quota (records.stored_size)
    UNIQUE (owner, document_id),
    UNIQUE (owner, seq)
);
CREATE TABLE IF NOT EXISTS document_metadata (
    document INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (document, key)
);
CREATE INDEX IF NOT EXISTS document_metadata_pair ON document_metadata (owner, key, value);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the FAISS id; AUTOINCREMENT never reuses one
    owner TEXT NOT NULL,
    document INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    chunk_index INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset INTEGER NOT NULL,
    text TEXT NOT NULL,
    vector BLOB NOT NULL,  -- float32, little-endian
    UNIQUE (document, chunk_index)
);
-- Serves per-owner scans (rebuilds) and the metadata filter (owner = ? AND document IN ...).
CREATE INDEX IF NOT EXISTS chunks_owner_document ON chunks (owner, document);
"""


@dataclass(frozen=True)
class PreparedDocument:
    """A checked document, ready to store: its vectors stacked as float32 [chunks, dimensions]."""

    document_id: str
    text: str
    metadata: dict[str, str]
    bytes: int  # UTF-8 bytes of the text
    stored_bytes: int  # records.stored_size
    spans: list[tuple[int, int, str]]  # (start, end, text) per chunk
    vectors: np.ndarray


@dataclass(frozen=True)
class OwnerUsage:
    """An owner's row in ``owners`` (zeros and no quota id before its first document)."""

    documents: int = 0
    bytes: int = 0
    quota_id: str | None = None


@dataclass(frozen=True)
class OpenedDatabase:
    connection: sqlite3.Connection
    generation: int
    database_id: int  # random, fixed when the database was created


def open_database(path: Path, dimensions: int) -> OpenedDatabase:
    """Open (creating if needed) the database in WAL mode with synchronous=FULL and foreign keys."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise RuntimeError(f"{path}: SQLite refused WAL mode")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(_SCHEMA)
        with Transaction(db):
            for key, value in (
                ("schema", SCHEMA_VERSION),
                ("dimensions", dimensions),
                ("generation", 0),
                # Ties snapshots to this database: one copied from another never passes for its own.
                ("database_id", secrets.randbits(62)),
            ):
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
            meta = dict(db.execute("SELECT key, value FROM meta"))
            if meta["schema"] == 1:
                _migrate_1_to_2(db)
                meta["schema"] = 2
        if meta["schema"] != SCHEMA_VERSION:
            raise ValueError(f"{path}: schema version {meta['schema']}, this server reads {SCHEMA_VERSION}")
        if meta["dimensions"] != dimensions:
            raise ValueError(
                f"dimensions: {path} holds vectors of {meta['dimensions']} dimensions, "
                f"the store was opened with {dimensions}"
            )
    except BaseException:
        db.close()
        raise
    return OpenedDatabase(db, int(meta["generation"]), int(meta["database_id"]))


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """Schema 1 -> 2, inside the caller's transaction: each document's stored size computed from its
    rows, owners' bytes recounted from them, and the (unknown, NULL) quota id of every owner."""
    db.execute("ALTER TABLE documents ADD COLUMN stored_bytes INTEGER NOT NULL DEFAULT 0")
    db.execute(
        "UPDATE documents SET stored_bytes = bytes"
        " + COALESCE((SELECT SUM(length(CAST(m.key AS BLOB)) + length(CAST(m.value AS BLOB)))"
        "   FROM document_metadata m WHERE m.document = documents.id), 0)"
        " + COALESCE((SELECT SUM(length(CAST(c.text AS BLOB)) + length(c.vector))"
        "   FROM chunks c WHERE c.document = documents.id), 0)"
    )
    db.execute("ALTER TABLE owners ADD COLUMN quota_id TEXT")
    db.execute(
        "UPDATE owners SET bytes = COALESCE((SELECT SUM(d.stored_bytes) FROM documents d"
        " WHERE d.owner = owners.owner), 0)"
    )
    db.execute("UPDATE meta SET value = 2 WHERE key = 'schema'")


def bump_generation(db: sqlite3.Connection) -> None:
    db.execute("UPDATE meta SET value = value + 1 WHERE key = 'generation'")


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (nothing half-written)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            try:
                self._db.execute("COMMIT")
                return
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")


def _batches(values: Sequence) -> Iterator[Sequence]:
    for start in range(0, len(values), _IN_BATCH):
        yield values[start : start + _IN_BATCH]


def select_in(
    db: sqlite3.Connection, sql: str, params: tuple, values: Sequence, after: tuple = ()
) -> list[tuple]:
    """Rows of ``sql`` whose ``IN ({})`` takes ``values`` (``params`` bound before it, ``after`` after it),
    in batches under SQLite's limit on parameters."""
    rows: list[tuple] = []
    for batch in _batches(values):
        rows += db.execute(sql.format(",".join("?" * len(batch))), (*params, *batch, *after)).fetchall()
    return rows


def execute_in(db: sqlite3.Connection, sql: str, params: tuple, values: Sequence) -> None:
    for batch in _batches(values):
        db.execute(sql.format(",".join("?" * len(batch))), (*params, *batch))


def owner_usage(db: sqlite3.Connection, owner: str) -> OwnerUsage:
    row = db.execute("SELECT documents, bytes, quota_id FROM owners WHERE owner = ?", (owner,)).fetchone()
    return OwnerUsage(*row) if row is not None else OwnerUsage()


def replaced_sizes(
    db: sqlite3.Connection, owner: str, document_ids: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """{document id: (row id, stored bytes)} of the owner's documents among ``document_ids``."""
    return {
        document_id: (row_id, size)
        for row_id, document_id, size in select_in(
            db,
            "SELECT id, document_id, stored_bytes FROM documents WHERE owner = ? AND document_id IN ({})",
            (owner,),
            document_ids,
        )
    }


def key_usage(db: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    """{quota id: (documents, stored bytes)} of the owners here that count against an API key."""
    rows = db.execute(
        "SELECT quota_id, SUM(documents), SUM(bytes) FROM owners WHERE quota_id IS NOT NULL GROUP BY quota_id"
    )
    return {quota_id: (documents, size) for quota_id, documents, size in rows}


def set_quota_id(db: sqlite3.Connection, owner: str, quota_id: str | None) -> None:
    db.execute("UPDATE owners SET quota_id = ? WHERE owner = ?", (quota_id, owner))


def check_limits(
    used: tuple[int, int], after: tuple[int, int], quotas: Quotas, holder: str = OWNER
) -> None:
    """QuotaExceeded if (documents, bytes) going from ``used`` to ``after`` passes one of ``quotas``.

    A call that does not grow a holder's use is allowed even past a (since lowered) limit.
    """
    for quota, before, now, limit in (
        ("documents", used[0], after[0], quotas.max_documents),
        ("bytes", used[1], after[1], quotas.max_bytes),
    ):
        if limit and now > limit and now > before:
            raise QuotaExceeded(quota, before, now, limit, holder)


def remove_documents(db: sqlite3.Connection, owner: str, rows: Sequence[tuple[int, int]]) -> list[int]:
    """Delete the owner's documents ((row id, stored bytes) each) with metadata and chunks; the chunk ids."""
    if not rows:
        return []
    row_ids = [row_id for row_id, _ in rows]
    chunk_ids = [
        r[0]
        for r in select_in(
            db, "SELECT id FROM chunks WHERE owner = ? AND document IN ({})", (owner,), row_ids
        )
    ]
    # "+owner": filter by owner without letting the planner scan the owner's index instead of the ids.
    execute_in(db, "DELETE FROM documents WHERE +owner = ? AND id IN ({})", (owner,), row_ids)
    db.execute(
        "UPDATE owners SET documents = documents - ?, bytes = bytes - ? WHERE owner = ?",
        (len(rows), sum(size for _, size in rows), owner),
    )
    return chunk_ids


def add_documents(
    db: sqlite3.Connection, owner: str, documents: Sequence[PreparedDocument], now: float
) -> list[int]:
    """Insert the documents after the owner's others in list order; their chunks' ids, in order."""
    db.execute(
        "INSERT INTO owners (owner, next_seq, documents, bytes) VALUES (?, 1, 0, 0) ON CONFLICT (owner) DO NOTHING",
        (owner,),
    )
    (first,) = db.execute("SELECT next_seq FROM owners WHERE owner = ?", (owner,)).fetchone()
    db.execute(
        "UPDATE owners SET next_seq = ?, documents = documents + ?, bytes = bytes + ? WHERE owner = ?",
        (first + len(documents), len(documents), sum(d.stored_bytes for d in documents), owner),
    )
    chunk_ids: list[int] = []
    for offset, document in enumerate(documents):
        chunk_ids += _insert_document(db, owner, first + offset, document, now)
    return chunk_ids


def _insert_document(
    db: sqlite3.Connection, owner: str, seq: int, document: PreparedDocument, now: float
) -> list[int]:
    """Insert the document, its metadata pairs and its chunks; the chunks' ids (their FAISS ids)."""
    metadata = json.dumps(document.metadata, sort_keys=True, ensure_ascii=False)
    row_id = db.execute(
        "INSERT INTO documents"
        " (owner, seq, document_id, text, metadata, bytes, chunk_count, indexed_at, stored_bytes)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            owner,
            seq,
            document.document_id,
            document.text,
            metadata,
            document.bytes,
            len(document.spans),
            now,
            document.stored_bytes,
        ),
    ).lastrowid
    db.executemany(
        "INSERT INTO document_metadata (document, owner, key, value) VALUES (?, ?, ?, ?)",
        [(row_id, owner, key, value) for key, value in document.metadata.items()],
    )
    vectors = document.vectors.astype("<f4", copy=False)
    return [
        db.execute(
            "INSERT INTO chunks (owner, document, chunk_index, start_offset, end_offset, text, vector)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (owner, row_id, chunk_index, start, end, text, vectors[chunk_index].tobytes()),
        ).lastrowid
        for chunk_index, (start, end, text) in enumerate(document.spans)
    ]


def hit_from_row(row: tuple, score: float) -> ChunkHit:
    _, document_id, chunk_index, start, end, text, metadata = row
    return ChunkHit(document_id, chunk_index, start, end, text, score, json.loads(metadata))
