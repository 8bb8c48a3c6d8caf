"""A partition's SQLite database: its schema and the statements the partition runs.

Every table row carries its owner's full identity and every statement filters by it. ``chunks.id``
(AUTOINCREMENT, so never reused) is the chunk's FAISS id. ``meta`` holds the schema version, the vector
dimensions, a random database id and the ``generation``, which every writing transaction raises.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protoserve.server.rag.records import ChunkHit, QuotaExceeded, Quotas

DB_NAME = "rag.sqlite3"
SCHEMA_VERSION = 1
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
    bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL REFERENCES owners(owner),
    seq INTEGER NOT NULL,
    document_id TEXT NOT NULL,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL,  -- JSON object of strings
    bytes INTEGER NOT NULL,
    chunk_count INTEGER NOT NULL,
    indexed_at REAL NOT NULL,
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
    bytes: int
    spans: list[tuple[int, int, str]]  # (start, end, text) per chunk
    vectors: np.ndarray


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


def check_quotas(
    db: sqlite3.Connection,
    owner: str,
    documents: Sequence[PreparedDocument],
    replaced: Sequence[tuple[int, int]],
    quotas: Quotas,
) -> None:
    """QuotaExceeded if storing ``documents`` (``replaced``: (row id, bytes) they replace) passes a limit."""
    row = db.execute("SELECT documents, bytes FROM owners WHERE owner = ?", (owner,)).fetchone()
    used_documents, used_bytes = row if row is not None else (0, 0)
    after_documents = used_documents - len(replaced) + len(documents)
    after_bytes = used_bytes - sum(size for _, size in replaced) + sum(d.bytes for d in documents)
    # A call that does not grow an owner's use is allowed even past a (since lowered) limit.
    for quota, used, after, limit in (
        ("documents", used_documents, after_documents, quotas.max_documents),
        ("bytes", used_bytes, after_bytes, quotas.max_bytes),
    ):
        if limit and after > limit and after > used:
            raise QuotaExceeded(quota, used, after, limit)


def remove_documents(db: sqlite3.Connection, owner: str, rows: Sequence[tuple[int, int]]) -> list[int]:
    """Delete the owner's documents ((row id, bytes) each) with their metadata and chunks; the chunk ids."""
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
        (first + len(documents), len(documents), sum(d.bytes for d in documents), owner),
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
        "INSERT INTO documents (owner, seq, document_id, text, metadata, bytes, chunk_count, indexed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (owner, seq, document.document_id, document.text, metadata, document.bytes, len(document.spans), now),
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
