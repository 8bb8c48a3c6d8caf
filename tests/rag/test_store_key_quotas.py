"""Quotas per API key over all its owners (every partition), and schema 1 stores migrated to stored sizes.

A key's owners land in different partitions (identity mod N), each with its own database: the key's
quota must hold over their sum, across restarts and concurrent writers, while each owner's own quota
still holds. A store written by schema 1 (text bytes only, no quota ids) opens with its documents'
stored sizes counted and its owners joining a key the first time they write under one.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading

import numpy as np
import pytest

from protoserve.server.rag.records import API_KEY, OWNER, stored_size
from protoserve.server.rag.store import (
    ChunkInput,
    DocumentInput,
    DocumentSize,
    QuotaExceeded,
    Quotas,
    RagStore,
)

DIM = 8
PARTITIONS = 4
RNG = np.random.default_rng(11)


def owner_in(partition: int, name: str) -> str:
    """An identity id (64 hex digits) that lands in ``partition``."""
    for salt in range(1000):
        owner = hashlib.sha256(f"{name}-{salt}".encode()).hexdigest()
        if int(owner, 16) % PARTITIONS == partition:
            return owner
    raise AssertionError("no owner found")


KEY = hashlib.sha256(b"team-key").hexdigest()
OTHER_KEY = hashlib.sha256(b"other-key").hexdigest()
ALICE, BOB, CAROL = owner_in(0, "alice"), owner_in(1, "bob"), owner_in(2, "carol")


def vector() -> np.ndarray:
    v = RNG.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def doc(document_id: str, text: str = "some text") -> DocumentInput:
    return DocumentInput(document_id, text, {}, [ChunkInput(0, len(text), text, vector())])


def size(text: str = "some text") -> int:
    return stored_size(text, {}, [text], DIM)


def store_at(path, key_quotas: Quotas, quotas: Quotas = Quotas(0, 0)) -> RagStore:
    return RagStore(path, partitions=PARTITIONS, dimensions=DIM, quotas=quotas, key_quotas=key_quotas)


def test_owners_of_one_key_share_its_quota_across_partitions(tmp_path):
    with store_at(tmp_path, Quotas(max_documents=3, max_bytes=0)) as store:
        store.index(ALICE, [doc("a1"), doc("a2")], key=KEY)
        store.index(BOB, [doc("b1")], key=KEY)
        with pytest.raises(QuotaExceeded) as raised:
            store.index(BOB, [doc("b2")], key=KEY)
        assert (raised.value.holder, raised.value.quota, raised.value.used, raised.value.requested) == (
            API_KEY,
            "documents",
            3,
            4,
        )
        assert "the API key has 3 documents" in str(raised.value)
        assert [d.document_id for d in store.list_documents(BOB, 10)[0]] == ["b1"]  # nothing written
        # The same quota refuses before embedding, as the service asks it to.
        with pytest.raises(QuotaExceeded, match="API key"):
            store.check_quotas(CAROL, [DocumentSize("c1", 10)], key=KEY)
        # Another key, and an owner without one, are not touched by this key's use.
        store.index(CAROL, [doc("c1"), doc("c2"), doc("c3")], key=OTHER_KEY)
        store.index(owner_in(3, "solo"), [doc("s1"), doc("s2"), doc("s3"), doc("s4")])
        # Replacing adds no document; deleting one of alice's frees room for bob.
        store.index(ALICE, [doc("a1", "replaced")], key=KEY)
        assert store.delete_documents(ALICE, ["a2"]) == (["a2"], [])
        store.index(BOB, [doc("b2")], key=KEY)
        assert store.key_use(KEY) == (3, 2 * size() + size("replaced"))
    # Reopened, the key's use is summed from its owners' partitions again.
    with store_at(tmp_path, Quotas(max_documents=3, max_bytes=0)) as store:
        assert store.key_use(KEY) == (3, 2 * size() + size("replaced"))
        with pytest.raises(QuotaExceeded, match="API key"):
            store.index(owner_in(3, "dave"), [doc("d1")], key=KEY)


def test_key_bytes_quota_and_per_call_override(tmp_path):
    with store_at(tmp_path, Quotas(max_documents=0, max_bytes=3 * size())) as store:
        store.index(ALICE, [doc("a1"), doc("a2")], key=KEY)
        with pytest.raises(QuotaExceeded) as raised:
            store.index(BOB, [doc("b1"), doc("b2")], key=KEY)
        assert (raised.value.holder, raised.value.quota) == (API_KEY, "bytes")
        # A key's own limits (the rate-limits file) replace the store's for its calls.
        store.index(BOB, [doc("b1"), doc("b2")], key=KEY, key_quotas=Quotas(0, 0))
    # The owner's own quota still holds under a generous key quota.
    with store_at(tmp_path, Quotas(0, 0), quotas=Quotas(max_documents=2, max_bytes=0)) as store:
        with pytest.raises(QuotaExceeded) as raised:
            store.index(ALICE, [doc("a3")], key=KEY)
        assert raised.value.holder == OWNER


def test_the_key_of_an_owner_without_auth_is_the_owner_itself(tmp_path):
    # With auth off, Identity.quota_id is the identity: no second count of the same use.
    with store_at(tmp_path, Quotas(max_documents=1, max_bytes=0)) as store:
        store.index(ALICE, [doc("a1"), doc("a2")], key=ALICE)
        assert store.key_use(ALICE) == (0, 0)


def test_concurrent_writers_under_one_key_never_pass_its_quota(tmp_path):
    owners = [owner_in(i % PARTITIONS, f"writer-{i}") for i in range(12)]
    with store_at(tmp_path, Quotas(max_documents=5, max_bytes=0)) as store:
        stored, refused = [], []
        barrier = threading.Barrier(len(owners))

        def write(owner: str) -> None:
            barrier.wait()
            try:
                store.index(owner, [doc("only")], key=KEY)
                stored.append(owner)
            except QuotaExceeded:
                refused.append(owner)

        threads = [threading.Thread(target=write, args=(o,)) for o in owners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (len(stored), len(refused)) == (5, 7)
        assert store.key_use(KEY) == (5, 5 * size())


# Schema 1, as the store wrote it before stored sizes and quota ids (server/rag/documents_db.py).
SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE owners (owner TEXT PRIMARY KEY, next_seq INTEGER NOT NULL, documents INTEGER NOT NULL,
                     bytes INTEGER NOT NULL);
CREATE TABLE documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL REFERENCES owners(owner),
    seq INTEGER NOT NULL, document_id TEXT NOT NULL, text TEXT NOT NULL, metadata TEXT NOT NULL,
    bytes INTEGER NOT NULL, chunk_count INTEGER NOT NULL, indexed_at REAL NOT NULL,
    UNIQUE (owner, document_id), UNIQUE (owner, seq));
CREATE TABLE document_metadata (
    document INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE, owner TEXT NOT NULL,
    key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (document, key));
CREATE INDEX document_metadata_pair ON document_metadata (owner, key, value);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL,
    document INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE, chunk_index INTEGER NOT NULL,
    start_offset INTEGER NOT NULL, end_offset INTEGER NOT NULL, text TEXT NOT NULL, vector BLOB NOT NULL,
    UNIQUE (document, chunk_index));
CREATE INDEX chunks_owner_document ON chunks (owner, document);
"""


def write_schema_1_store(root, owner: str, text: str, metadata: dict[str, str], spans, vectors) -> None:
    partition = root / "partition-0"
    partition.mkdir(parents=True)
    (root / "layout.json").write_text(json.dumps({"partitions": 1}))
    db = sqlite3.connect(partition / "rag.sqlite3")
    db.executescript(SCHEMA_1)
    for key, value in (("schema", 1), ("dimensions", DIM), ("generation", 1), ("database_id", 42)):
        db.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
    text_bytes = len(text.encode("utf-8"))
    db.execute("INSERT INTO owners VALUES (?, 2, 1, ?)", (owner, text_bytes))
    db.execute(
        "INSERT INTO documents (owner, seq, document_id, text, metadata, bytes, chunk_count, indexed_at)"
        " VALUES (?, 1, 'old', ?, ?, ?, ?, 0)",
        (owner, text, json.dumps(metadata), text_bytes, len(spans)),
    )
    for key, value in metadata.items():
        db.execute("INSERT INTO document_metadata VALUES (1, ?, ?, ?)", (owner, key, value))
    for i, ((start, end), v) in enumerate(zip(spans, vectors, strict=True)):
        db.execute(
            "INSERT INTO chunks (owner, document, chunk_index, start_offset, end_offset, text, vector)"
            " VALUES (?, 1, ?, ?, ?, ?, ?)",
            (owner, i, start, end, text[start:end], v.astype("<f4").tobytes()),
        )
    db.commit()
    db.close()


def test_a_schema_1_store_is_migrated_to_stored_sizes(tmp_path):
    text = "Zürich ist schön. Zweiter Satz hier."
    metadata = {"lang": "de"}
    spans = [(0, 17), (10, 36)]
    vectors = [vector(), vector()]
    write_schema_1_store(tmp_path, ALICE, text, metadata, spans, vectors)
    expected = stored_size(text, metadata, [text[s:e] for s, e in spans], DIM)
    with RagStore(tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(0, expected)) as store:
        [info], _ = store.list_documents(ALICE, 10)
        assert (info.document_id, info.bytes, info.chunks) == ("old", len(text.encode("utf-8")), 2)
        assert store.search(ALICE, vectors[1], 1)[0].chunk_index == 1  # indexes rebuilt from SQLite
        # The owner's use is now its stored size: at the limit, any growth is refused.
        with pytest.raises(QuotaExceeded) as raised:
            store.index(ALICE, [doc("new", "x")])
        assert (raised.value.used, raised.value.limit) == (expected, expected)
        # Writing under a key for the first time brings the owner's existing use into the key's.
        store.index(ALICE, [doc("old", "short")], key=KEY)
        assert store.key_use(KEY) == (1, size("short"))
    with sqlite3.connect(tmp_path / "partition-0" / "rag.sqlite3") as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (2,)
        assert db.execute("SELECT quota_id FROM owners").fetchone() == (KEY,)
