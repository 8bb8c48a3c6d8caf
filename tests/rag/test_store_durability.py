"""Crashes and damaged snapshots: acknowledged documents survive kill -9 whole; indexes rebuild from SQLite."""

from __future__ import annotations

import hashlib
import logging
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from protoserve.server.rag.partition_store import SNAPSHOT_NAME
from protoserve.server.rag.store import RagStore

DIM = 16
CHUNKS = 3
OWNERS = [hashlib.sha256(f"owner-{n}".encode()).hexdigest() for n in range(3)]
LOGGER = "protoserve.server.rag.partition_store"

# Document i: owner OWNERS[i % 3], CHUNKS chunks whose vectors come from default_rng(i).
_HELPERS = """
import numpy as np
from protoserve.server.rag.store import ChunkInput, DocumentInput

def vectors_of(i, dim, chunks):
    v = np.random.default_rng(i).standard_normal((chunks, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)

def document_of(i, dim, chunks):
    words = [f"d{i}c{j}" for j in range(chunks)]
    text = " ".join(words)
    spans, at = [], 0
    for word, vector in zip(words, vectors_of(i, dim, chunks)):
        spans.append(ChunkInput(at, at + len(word), word, vector))
        at += len(word) + 1
    return DocumentInput(f"doc-{i}", text, {"n": str(i)}, spans)
"""
namespace: dict = {}
exec(_HELPERS, namespace)
vectors_of, document_of = namespace["vectors_of"], namespace["document_of"]

_WRITER = (
    _HELPERS
    + """
import sys
from pathlib import Path
from protoserve.server.rag.store import RagStore

root, kind, owners = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
dim, chunks, first = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = RagStore(Path(root), partitions=2, dimensions=dim, index_kind=kind)
for i in range(first, 100_000):
    store.index(owners[i % len(owners)], [document_of(i, dim, chunks)])
    print(f"doc-{i}", flush=True)
    if i % 7 == 6:
        store.snapshot()  # so a kill can also land in the middle of a snapshot
"""
)


def open_store(root, kind: str) -> RagStore:
    return RagStore(root, partitions=2, dimensions=DIM, index_kind=kind)


def run_writer_and_kill(root, kind: str, first: int, acknowledged_wanted: int, delay_s: float) -> list[int]:
    """Start a writer at document ``first``, SIGKILL it ``delay_s`` after its ``acknowledged_wanted``-th
    acknowledgement; the numbers of the documents it acknowledged."""
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), kind, ",".join(OWNERS), str(DIM), str(CHUNKS), str(first)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acknowledged = []
    try:
        for line in writer.stdout:
            acknowledged.append(int(line.strip().removeprefix("doc-")))
            if len(acknowledged) == acknowledged_wanted:
                break
        assert len(acknowledged) == acknowledged_wanted, writer.stderr.read()
        time.sleep(delay_s)
        writer.send_signal(signal.SIGKILL)
        # Read what it acknowledged before it died: those are promises too.
        for line in writer.stdout:
            acknowledged.append(int(line.strip().removeprefix("doc-")))
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
        writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL
    return acknowledged


def assert_complete(store: RagStore, acknowledged: list[int]) -> None:
    """Every acknowledged document is searchable first by its own vectors; no document is partial."""
    for i in acknowledged:
        owner = OWNERS[i % len(OWNERS)]
        for j, vector in enumerate(vectors_of(i, DIM, CHUNKS)):
            hit = store.search(owner, vector, 1)[0]
            assert (hit.document_id, hit.chunk_index) == (f"doc-{i}", j)
            assert hit.score == pytest.approx(1.0, abs=1e-5)
    for owner in OWNERS:
        listed, _ = store.list_documents(owner, 1000)
        for info in listed:
            _, _, chunks = store.get_document(owner, info.document_id)
            assert info.chunks == len(chunks) == CHUNKS, info
        assert {d.document_id for d in listed} >= {f"doc-{i}" for i in acknowledged if OWNERS[i % 3] == owner}


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_kill_mid_stream_loses_no_acknowledged_document(tmp_path, kind, caplog):
    root = tmp_path / "rag"
    acknowledged: list[int] = []
    # Four writers in turn, each killed at another moment of its calls; each starts with the document
    # the one before may have committed unacknowledged, so that one is replaced after a crash.
    for round, delay_s in enumerate((0.0, 0.003, 0.007, 0.013)):
        first = len(acknowledged)
        acknowledged += run_writer_and_kill(root, kind, first, 10 + 5 * round, delay_s)
        assert acknowledged == list(range(len(acknowledged)))
    caplog.set_level(logging.INFO, logger=LOGGER)
    with open_store(root, kind) as store:
        assert_complete(store, acknowledged)
        listed = sum(len(store.list_documents(owner, 1000)[0]) for owner in OWNERS)
        # At most the call in flight at the last kill committed without being acknowledged.
        assert len(acknowledged) <= listed <= len(acknowledged) + 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Reopening (from the snapshot close wrote, this time) keeps everything, twice.
    for _ in range(2):
        caplog.clear()
        with open_store(root, kind) as store:
            assert_complete(store, acknowledged)
        assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]


@pytest.fixture(scope="module")
def closed_store(tmp_path_factory):
    """A closed flat store with 12 documents and a current snapshot."""
    root = tmp_path_factory.mktemp("rag") / "rag"
    with open_store(root, "flat") as store:
        for i in range(12):
            store.index(OWNERS[i % 3], [document_of(i, DIM, CHUNKS)])
    return root


def _garbage(data: bytes) -> bytes:
    return np.random.default_rng(0).bytes(len(data))


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _one_flipped_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]


@pytest.mark.parametrize("damage", [_garbage, _truncated, _one_flipped_byte, lambda data: b""])
def test_a_damaged_snapshot_is_rebuilt_with_one_warning(tmp_path, closed_store, damage, caplog):
    root = tmp_path / "rag"
    shutil.copytree(closed_store, root)
    damaged = []
    for snapshot in root.glob(f"partition-*/{SNAPSHOT_NAME}"):
        snapshot.write_bytes(damage(snapshot.read_bytes()))
        damaged.append(snapshot.parent.name)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with open_store(root, "flat") as store:
        assert_complete(store, list(range(12)))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(w.getMessage().split(":")[0] for w in warnings) == sorted(f"RAG {p}" for p in damaged)
    assert all(
        "damaged" in w.getMessage() and w.exc_info is None and "\n" not in w.getMessage() for w in warnings
    )
    # The rebuild wrote a good snapshot: the next open loads it silently.
    caplog.clear()
    with open_store(root, "flat") as store:
        assert_complete(store, list(range(12)))
    assert not caplog.records


def test_a_stale_snapshot_is_rebuilt_from_sqlite(tmp_path, closed_store, caplog):
    root = tmp_path / "rag"
    shutil.copytree(closed_store, root)
    old = {p: p.read_bytes() for p in root.glob(f"partition-*/{SNAPSHOT_NAME}")}
    with open_store(root, "flat") as store:
        for i in range(12, 18):
            store.index(OWNERS[i % 3], [document_of(i, DIM, CHUNKS)])
        store.delete_documents(OWNERS[0], ["doc-0"])
    for path, data in old.items():
        path.write_bytes(data)  # generation behind SQLite's, as after a crash before the next snapshot
    caplog.set_level(logging.INFO, logger=LOGGER)
    with open_store(root, "flat") as store:
        assert_complete(store, list(range(1, 18)))
        assert store.get_document(OWNERS[0], "doc-0") is None
        assert all(
            h.document_id != "doc-0" for h in store.search(OWNERS[0], vectors_of(0, DIM, CHUNKS)[0], 100)
        )
    messages = [r.getMessage() for r in caplog.records]
    assert any("snapshot is at generation" in m and "rebuilding" in m for m in messages), messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_snapshot_of_other_data_at_the_same_generation_is_not_trusted(tmp_path, caplog):
    """Generation equal but the ids differ (a snapshot copied from elsewhere): rebuilt, with a warning."""
    roots = [tmp_path / "a", tmp_path / "b"]
    for offset, root in enumerate(roots):
        with RagStore(root, partitions=1, dimensions=DIM) as store:
            for i in range(4):
                store.index(OWNERS[0], [document_of(10 * offset + i, DIM, CHUNKS)])
    shutil.copy(roots[0] / "partition-0" / SNAPSHOT_NAME, roots[1] / "partition-0" / SNAPSHOT_NAME)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with RagStore(roots[1], partitions=1, dimensions=DIM) as store:
        hit = store.search(OWNERS[0], vectors_of(12, DIM, CHUNKS)[1], 1)[0]
        assert (hit.document_id, hit.chunk_index) == ("doc-12", 1)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "damaged" in caplog.records[0].getMessage()


def test_switching_index_kind_rebuilds_and_keeps_documents(tmp_path, closed_store, caplog):
    root = tmp_path / "rag"
    shutil.copytree(closed_store, root)
    with open_store(root, "hnsw") as store:
        assert_complete(store, list(range(12)))
    with open_store(root, "flat") as store:
        assert_complete(store, list(range(12)))
