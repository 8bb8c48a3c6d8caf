"""Per-owner quotas on documents and text bytes, with replacements, checked before anything is written."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from protoserve.server.rag.store import ChunkInput, DocumentInput, QuotaExceeded, Quotas, RagStore

DIM = 8
OWNER = hashlib.sha256(b"quota-owner").hexdigest()
RNG = np.random.default_rng(9)


def doc(document_id: str, text: str) -> DocumentInput:
    vector = RNG.standard_normal(DIM).astype(np.float32)
    vector /= np.linalg.norm(vector)
    return DocumentInput(document_id, text, {}, [ChunkInput(0, len(text), text, vector)])


def ids(store: RagStore) -> list[str]:
    return [d.document_id for d in store.list_documents(OWNER, 100)[0]]


def test_document_quota_counts_replacements_as_no_new_document(tmp_path):
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=3, max_bytes=0)
    ) as store:
        store.index(OWNER, [doc("a", "x"), doc("b", "x")])
        store.index(OWNER, [doc("c", "x")])
        generation = store._partitions[0].generation
        with pytest.raises(QuotaExceeded) as raised:
            store.index(OWNER, [doc("d", "new")])
        assert (raised.value.quota, raised.value.used, raised.value.requested, raised.value.limit) == (
            "documents",
            3,
            4,
            3,
        )
        assert str(raised.value) == (
            "documents quota exceeded: the owner has 3 documents, this call would make it 4, the limit is 3"
        )
        # Nothing was written: no document, no chunk, no generation.
        assert ids(store) == ["a", "b", "c"]
        assert store._partitions[0].generation == generation
        assert all(h.text == "x" for h in store.search(OWNER, doc("q", "q").chunks[0].vector, 10))
        # Replacing at the limit is fine; a call that replaces one and adds one is not.
        assert [d.replaced for d in store.index(OWNER, [doc("a", "replaced"), doc("b", "again")])] == [
            True,
            True,
        ]
        with pytest.raises(QuotaExceeded, match="documents quota"):
            store.index(OWNER, [doc("a", "x"), doc("d", "x")])
        assert ids(store) == ["c", "a", "b"]
        # Deleting frees room.
        store.delete_documents(OWNER, ["c"])
        store.index(OWNER, [doc("d", "x")])
        assert ids(store) == ["a", "b", "d"]


def stored(text: str) -> int:
    """What ``doc(_, text)`` costs the byte quota: its text, its one chunk's text and its vector."""
    return 2 * len(text.encode("utf-8")) + 4 * DIM


def test_byte_quota_counts_stored_bytes_and_replacements(tmp_path):
    # Before stored sizes, this test counted text bytes only (limit 100 = 40 + 40 + 20); the same
    # steps now count each document's text, its chunk's text and its 8-dimension vector.
    limit = 2 * stored("x" * 40) + stored("x" * 20)
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=0, max_bytes=limit)
    ) as store:
        store.index(OWNER, [doc("a", "x" * 40), doc("b", "x" * 40)])
        with pytest.raises(QuotaExceeded) as raised:
            store.index(OWNER, [doc("c", "x" * 21)])
        used = 2 * stored("x" * 40)
        assert (raised.value.quota, raised.value.used, raised.value.requested, raised.value.limit) == (
            "bytes",
            used,
            used + stored("x" * 21),
            limit,
        )
        assert str(raised.value) == (
            f"bytes quota exceeded: the owner has {used} stored bytes, this call would make it "
            f"{used + stored('x' * 21)}, the limit is {limit}"
        )
        store.index(OWNER, [doc("c", "x" * 20)])  # exactly at the limit
        # Replacing "a" (40 bytes) with 40 UTF-8 bytes fits; with 41 it does not.
        store.index(OWNER, [doc("a", "é" * 20)])  # 20 characters, 40 UTF-8 bytes
        with pytest.raises(QuotaExceeded, match="bytes quota"):
            store.index(OWNER, [doc("a", "é" * 20 + "x")])
        info, text, _ = store.get_document(OWNER, "a")
        assert (text, info.bytes) == ("é" * 20, 40)  # a document's bytes are still its text's
        # Shrinking a document makes room for another.
        d_text = "x" * ((stored("x" * 40) - stored("x" * 10) - 4 * DIM) // 2)  # what b's shrinking freed
        store.index(OWNER, [doc("b", "x" * 10), doc("d", d_text)])
        with pytest.raises(QuotaExceeded) as raised:
            store.index(OWNER, [doc("e", "x")])
        assert raised.value.used == limit
    # The use the quota counts survives a restart and matches the documents.
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=0, max_bytes=limit)
    ) as store:
        with pytest.raises(QuotaExceeded) as raised:
            store.index(OWNER, [doc("e", "x")])
        assert (raised.value.used, raised.value.requested) == (limit, limit + stored("x"))
        store.delete_documents(OWNER, ["d"])
        store.index(OWNER, [doc("e", d_text)])


def test_small_overlapping_chunks_count_every_copy_and_vector(tmp_path):
    text = "word " * 100  # 500 bytes
    # 100 chunks of 3 words each, overlapping by 2: the text stored three times over, plus 100 vectors.
    chunks = [ChunkInput(5 * i, 5 * i + 14, text[5 * i : 5 * i + 14], doc("v", "v").chunks[0].vector)
              for i in range(98)]  # fmt: skip
    size = 500 + sum(len(c.text) for c in chunks) + 98 * 4 * DIM
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=0, max_bytes=size - 1)
    ) as store:
        with pytest.raises(QuotaExceeded) as raised:
            store.index(OWNER, [DocumentInput("many", text, {}, chunks)])
        assert raised.value.requested == size
        store.index(OWNER, [DocumentInput("few", text, {}, chunks[:10])])


def test_a_lowered_quota_still_lets_an_owner_shrink(tmp_path):
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=0, max_bytes=0)
    ) as store:
        store.index(OWNER, [doc(str(i), "x" * 50) for i in range(4)])
    with RagStore(
        tmp_path, partitions=1, dimensions=DIM, quotas=Quotas(max_documents=2, max_bytes=100)
    ) as store:
        assert [d.replaced for d in store.index(OWNER, [doc("0", "y" * 10)])] == [True]
        with pytest.raises(QuotaExceeded, match="bytes"):
            store.index(OWNER, [doc("1", "y" * 60)])  # 160 -> 170: grows past the limit
        with pytest.raises(QuotaExceeded, match="documents"):
            store.index(OWNER, [doc("9", "")])
        assert store.delete_documents(OWNER, ["2", "3"]) == (["2", "3"], [])
        assert len(ids(store)) == 2
