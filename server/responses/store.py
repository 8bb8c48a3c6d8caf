"""ResponseStore: the Responses API's stored responses, in partitions chosen by the owner's identity.

The owner is the caller's ``Identity.id`` (hex HMAC-SHA256) and its partition ``int(owner, 16) %
PARTITIONS``, as the RAG store places documents, so no caller ever names a partition and every
statement filters by the owner: another identity's response id is simply not found. Layout under
``root``::

    partition-<k>/responses.sqlite3   (+ -wal, -shm) responses and their input items

A response is opaque bytes to this module (the serialized ``Response``), and so is each input item;
the store keeps their order, ids and sizes. Stored bytes are bounded per owner and per API key
(``Identity.quota_id``: every user id under one key shares the key's bound), checked before a
response is generated (``check_room``); the response then stored may pass the bound by its own size.
Each key's total over the partitions is kept in memory, summed from them when the store opens.
Methods block and are thread-safe (one lock per partition); call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PARTITIONS = 16
DB_NAME = "responses.sqlite3"
# Identity.id is 64 hex digits; the cap only keeps absurd owners out of every row.
_OWNER = re.compile(r"[0-9a-f]{1,128}")
# The longest chain of previous_response_id links followed; a longer conversation has outgrown
# every context window this server loads long before.
MAX_CHAIN = 4096

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    quota_id TEXT NOT NULL,
    previous_id TEXT,
    created_at REAL NOT NULL,
    body BLOB NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (owner, id)
);
CREATE TABLE IF NOT EXISTS input_items (
    owner TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (owner, response_id, position)
);
"""


@dataclass(frozen=True)
class StoredItem:
    """One input item: its id and its serialized form."""

    id: str
    body: bytes


@dataclass(frozen=True)
class StoredResponse:
    """A response as stored: its serialized form, the response it continues and its input items."""

    id: str
    body: bytes
    previous_id: str | None
    created_at: float
    items: tuple[StoredItem, ...] = ()

    @property
    def size(self) -> int:
        """Stored bytes it counts against its owner's and key's bounds."""
        return len(self.id) + len(self.body) + sum(len(i.id) + len(i.body) for i in self.items)


@dataclass(frozen=True)
class ItemPage:
    """A page of a response's input items."""

    items: list[StoredItem]
    has_more: bool


class StoreFull(Exception):
    """Storing more would pass the owner's or its API key's bound of stored bytes."""


class MissingLink(LookupError):
    """A response earlier in a previous_response_id chain is gone (deleted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass(frozen=True)
class Bounds:
    """Stored bytes allowed per owner and per API key; 0 is no bound."""

    owner_bytes: int = 64 * 1024 * 1024
    key_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("owner_bytes", "key_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a whole number of bytes >= 0, got {value!r}")


class _Partition:
    """One partition's SQLite database, serialized by its lock."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(directory / DB_NAME, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a response the caller was told is stored survives a crash
        self.db.executescript(_SCHEMA)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.db.close()


class ResponseStore:
    """Put, get, list the input items of, walk and delete an owner's responses."""

    def __init__(self, root: Path, bounds: Bounds = Bounds()) -> None:
        self._root = Path(root)
        self._bounds = bounds
        self._partitions: dict[int, _Partition] = {}
        self._partitions_lock = threading.Lock()
        self._key_use: dict[str, int] = {}
        self._key_lock = threading.Lock()
        self._root.mkdir(parents=True, exist_ok=True)
        for k in range(PARTITIONS):
            if (self._directory(k) / DB_NAME).exists():
                partition = self._partition_at(k)
                with partition.lock:
                    rows = partition.db.execute("SELECT quota_id, SUM(size) FROM responses GROUP BY quota_id")
                    for quota_id, size in rows:
                        self._key_use[quota_id] = self._key_use.get(quota_id, 0) + size

    def close(self) -> None:
        with self._partitions_lock:
            for partition in self._partitions.values():
                partition.close()
            self._partitions.clear()

    # --- bounds ------------------------------------------------------------------------------

    def owner_use(self, owner: str) -> int:
        """Bytes ``owner``'s responses hold."""
        partition = self._partition(owner)
        with partition.lock:
            (used,) = partition.db.execute(
                "SELECT COALESCE(SUM(size), 0) FROM responses WHERE owner = ?", (owner,)
            ).fetchone()
        return used

    def key_use(self, quota_id: str) -> int:
        """Bytes the responses of every owner under this key hold."""
        with self._key_lock:
            return self._key_use.get(quota_id, 0)

    def check_room(self, owner: str, quota_id: str, incoming: int) -> None:
        """StoreFull when ``incoming`` more bytes would pass the owner's or its key's bound."""
        checks = (("identity", self.owner_use(owner), self._bounds.owner_bytes),
                  ("api key", self.key_use(quota_id), self._bounds.key_bytes))
        for holder, used, bound in checks:
            if bound and used + incoming > bound:
                raise StoreFull(
                    f"stored responses of this {holder} hold {used} bytes of {bound}; "
                    "delete some (DELETE /v1/responses/{id}) or send store: false"
                )

    # --- writes ------------------------------------------------------------------------------

    def put(self, owner: str, quota_id: str, response: StoredResponse) -> None:
        """Store ``response`` (replacing one of the same id), durable before this returns."""
        size = response.size
        with self._partition(owner).transaction() as db:
            old = db.execute(
                "SELECT quota_id, size FROM responses WHERE owner = ? AND id = ?", (owner, response.id)
            ).fetchone()
            db.execute("DELETE FROM input_items WHERE owner = ? AND response_id = ?", (owner, response.id))
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (owner, response.id, quota_id, response.previous_id, response.created_at, response.body, size),
            )
            db.executemany(
                "INSERT INTO input_items VALUES (?, ?, ?, ?, ?)",
                [(owner, response.id, i, item.id, item.body) for i, item in enumerate(response.items)],
            )
        if old is not None:
            self._add_key_use(old[0], -old[1])
        self._add_key_use(quota_id, size)

    def delete(self, owner: str, response_id: str) -> bool:
        """Delete one of ``owner``'s responses; False when it has none of that id."""
        with self._partition(owner).transaction() as db:
            old = db.execute(
                "SELECT quota_id, size FROM responses WHERE owner = ? AND id = ?", (owner, response_id)
            ).fetchone()
            if old is None:
                return False
            db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id))
            db.execute("DELETE FROM input_items WHERE owner = ? AND response_id = ?", (owner, response_id))
        self._add_key_use(old[0], -old[1])
        return True

    # --- reads -------------------------------------------------------------------------------

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """One of ``owner``'s responses with its input items; None when it has none of that id."""
        partition = self._partition(owner)
        with partition.lock:
            return self._read(partition.db, owner, response_id)

    def chain(self, owner: str, response_id: str) -> list[StoredResponse] | None:
        """The conversation ending with ``response_id``, oldest first; None when ``owner`` has no
        response of that id, MissingLink when one earlier in it was deleted."""
        partition = self._partition(owner)
        chain: list[StoredResponse] = []
        with partition.lock:
            next_id: str | None = response_id
            while next_id is not None and len(chain) < MAX_CHAIN:
                found = self._read(partition.db, owner, next_id)
                if found is None:
                    if not chain:
                        return None
                    raise MissingLink(next_id)
                chain.append(found)
                next_id = found.previous_id
        chain.reverse()
        return chain

    def input_items(
        self, owner: str, response_id: str, *, after: str | None, limit: int, descending: bool
    ) -> ItemPage | None:
        """A page of a response's input items in order (or reversed); None when ``owner`` has no
        response of that id, LookupError when ``after`` names no item of it."""
        found = self.get(owner, response_id)
        if found is None:
            return None
        items = list(reversed(found.items)) if descending else list(found.items)
        start = 0
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise LookupError(after)
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return ItemPage(page, start + limit < len(items))

    # --- internals ---------------------------------------------------------------------------

    @staticmethod
    def _read(db: sqlite3.Connection, owner: str, response_id: str) -> StoredResponse | None:
        row = db.execute(
            "SELECT body, previous_id, created_at FROM responses WHERE owner = ? AND id = ?",
            (owner, response_id),
        ).fetchone()
        if row is None:
            return None
        items = db.execute(
            "SELECT item_id, body FROM input_items WHERE owner = ? AND response_id = ? ORDER BY position",
            (owner, response_id),
        ).fetchall()
        return StoredResponse(
            response_id, row[0], row[1], row[2], tuple(StoredItem(i, b) for i, b in items)
        )

    def _add_key_use(self, quota_id: str, change: int) -> None:
        with self._key_lock:
            total = self._key_use.get(quota_id, 0) + change
            if total > 0:
                self._key_use[quota_id] = total
            else:
                self._key_use.pop(quota_id, None)

    def _directory(self, k: int) -> Path:
        return self._root / f"partition-{k}"

    def _partition(self, owner: str) -> _Partition:
        if not isinstance(owner, str) or not _OWNER.fullmatch(owner):
            raise ValueError("owner: must be an identity (hex digits)")
        return self._partition_at(int(owner, 16) % PARTITIONS)

    def _partition_at(self, k: int) -> _Partition:
        with self._partitions_lock:
            partition = self._partitions.get(k)
            if partition is None:
                partition = self._partitions[k] = _Partition(self._directory(k))
            return partition
