"""Owners never see or touch each other's documents, whether they share a partition or not."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from protoserve.server.rag.store import ChunkInput, DocumentInput, Quotas, RagStore

DIM = 16


def owner_in(partition: int, partitions: int, seed: str) -> str:
    """An identity-like hex owner whose partition is ``partition``."""
    for n in range(1000):
        owner = hashlib.sha256(f"{seed}-{n}".encode()).hexdigest()
        if RagStore.partition_of(owner, partitions) == partition:
            return owner
    raise AssertionError("no owner found")


def documents(label: str, vectors: np.ndarray) -> list[DocumentInput]:
    """The same ids, metadata and vectors for every owner; only the text says whose it is."""
    docs = []
    for i, vector in enumerate(vectors):
        text = f"{label} {i}"
        docs.append(
            DocumentInput(f"doc-{i}", text, {"shared": "yes"}, [ChunkInput(0, len(text), text, vector)])
        )
    return docs


@pytest.fixture
def vectors():
    v = np.random.default_rng(3).standard_normal((6, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


PAIRS = [
    pytest.param(1, owner_in(0, 1, "alice"), owner_in(0, 1, "bob"), id="same-partition"),
    pytest.param(2, owner_in(0, 2, "alice"), owner_in(1, 2, "bob"), id="different-partitions"),
]


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
@pytest.mark.parametrize(("partitions", "alice", "bob"), PAIRS)
def test_owners_with_identical_ids_and_vectors_stay_apart(tmp_path, vectors, kind, partitions, alice, bob):
    root = tmp_path / "rag"
    with RagStore(root, partitions=partitions, dimensions=DIM, index_kind=kind) as store:
        store.index(alice, documents("alice", vectors))
        # Bob's first index of the same ids is not a replacement of Alice's.
        assert [d.replaced for d in store.index(bob, documents("bob", vectors))] == [False] * 6
        check_apart(store, vectors, alice, bob)
        # Deleting by one owner touches only its own documents.
        assert store.delete_documents(alice, ["doc-0", "doc-1"]) == (["doc-0", "doc-1"], [])
        assert store.delete_documents(alice, ["doc-0"]) == ([], ["doc-0"])
        assert store.get_document(bob, "doc-0")[1] == "bob 0"
        assert [h.text for h in store.search(bob, vectors[0], 1)] == ["bob 0"]
        assert len(store.search(bob, vectors[0], 100)) == 6
        assert len(store.list_documents(bob, 100)[0]) == 6
        assert len(store.list_documents(alice, 100)[0]) == 4
        # A page token is only a position: whoever presents it pages through its own documents.
        _, token = store.list_documents(alice, 2)
        assert [d.document_id for d in store.list_documents(bob, 10, token)[0]] == ["doc-4", "doc-5"]
        assert {h.text.split()[0] for h in store.search(bob, vectors[3], 100, filter={"shared": "yes"})} == {
            "bob"
        }
    # And after a restart, loaded from the snapshot.
    with RagStore(root, partitions=partitions, dimensions=DIM, index_kind=kind) as store:
        assert {h.text.split()[0] for h in store.search(alice, vectors[3], 100)} == {"alice"}
        assert len(store.search(alice, vectors[3], 100)) == 4
        assert {h.text.split()[0] for h in store.search(bob, vectors[3], 100)} == {"bob"}
        assert store.get_document(alice, "doc-0") is None


def check_apart(store: RagStore, vectors: np.ndarray, alice: str, bob: str) -> None:
    for owner, label in ((alice, "alice"), (bob, "bob")):
        for i, vector in enumerate(vectors):
            hits = store.search(owner, vector, 100)
            assert len(hits) == 6
            assert {h.text.split()[0] for h in hits} == {label}
            assert hits[0].text == f"{label} {i}"
            assert {
                h.text.split()[0] for h in store.search(owner, vector, 100, filter={"shared": "yes"})
            } == {label}
        listed, token = store.list_documents(owner, 100)
        assert [d.document_id for d in listed] == [f"doc-{i}" for i in range(6)] and token == ""
        info, text, chunks = store.get_document(owner, "doc-2")
        assert text == f"{label} 2" and [c.text for c in chunks] == [text]


def test_a_third_owner_sees_nothing(tmp_path, vectors):
    alice, carol = owner_in(0, 1, "alice"), owner_in(0, 1, "carol")
    with RagStore(tmp_path / "rag", partitions=1, dimensions=DIM) as store:
        store.index(alice, documents("alice", vectors))
        assert store.search(carol, vectors[0], 10) == []
        assert store.list_documents(carol, 10) == ([], "")
        assert store.get_document(carol, "doc-0") is None
        assert store.delete_documents(carol, ["doc-0"]) == ([], ["doc-0"])
        assert len(store.search(alice, vectors[0], 10)) == 6


def test_quotas_count_each_owner_alone(tmp_path, vectors):
    alice, bob = owner_in(0, 1, "alice"), owner_in(0, 1, "bob")
    with RagStore(tmp_path / "rag", partitions=1, dimensions=DIM, quotas=Quotas(max_documents=6)) as store:
        store.index(alice, documents("alice", vectors))
        store.index(bob, documents("bob", vectors))
        assert len(store.list_documents(bob, 100)[0]) == 6


def test_reads_of_an_owner_create_no_partition(tmp_path, vectors):
    root = tmp_path / "rag"
    owner = owner_in(1, 4, "dave")
    with RagStore(root, partitions=4, dimensions=DIM) as store:
        assert store.search(owner, vectors[0], 3) == []
        assert store.list_documents(owner, 3) == ([], "")
        assert not (root / "partition-1").exists()
        store.index(owner, documents("dave", vectors[:1]))
        assert (root / "partition-1" / "rag.sqlite3").exists()
        assert sorted(p.name for p in root.glob("partition-*")) == ["partition-1"]
