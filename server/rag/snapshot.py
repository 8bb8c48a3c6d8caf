"""A partition's FAISS snapshot file: every owner's serialized index and the generation it matches.

Layout: ``MAGIC``, a little-endian u32 header length, a JSON header (database id, generation, index
kind, dimensions, each owner with its index's byte length, in payload order), the payloads, and a SHA-256
of everything before it. The digest is checked before FAISS parses anything, so a damaged file is
reported as such instead of reaching FAISS's reader. Writes go to a temporary file that is fsynced
and then renamed over the old one, so a crash leaves either snapshot whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"PSRAGIX1"
_HEADER_LENGTH = struct.Struct("<I")
_DIGEST_BYTES = hashlib.sha256().digest_size


class SnapshotError(Exception):
    """The snapshot file exists but cannot be used: truncated, damaged or not a snapshot."""


@dataclass(frozen=True)
class Snapshot:
    database_id: int  # the SQLite database it was made from (random, set when it was created)
    generation: int  # that database's generation these indexes reflect
    index_kind: str
    dimensions: int
    indexes: dict[str, np.ndarray]  # owner -> faiss.serialize_index bytes (uint8)


def write_snapshot(path: Path, snapshot: Snapshot) -> None:
    """Replace ``path`` with ``snapshot`` atomically and durably."""
    header = json.dumps(
        {
            "database_id": snapshot.database_id,
            "generation": snapshot.generation,
            "index_kind": snapshot.index_kind,
            "dimensions": snapshot.dimensions,
            "owners": [[owner, int(data.nbytes)] for owner, data in snapshot.indexes.items()],
        }
    ).encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in (MAGIC, _HEADER_LENGTH.pack(len(header)), header, *snapshot.indexes.values()):
            view = memoryview(part).cast("B")
            digest.update(view)
            out.write(view)
        out.write(digest.digest())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def read_snapshot(path: Path) -> Snapshot | None:
    """The snapshot at ``path``; None when there is none; SnapshotError when it is damaged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SnapshotError(f"cannot read it: {e.strerror or e}") from None
    body_end = len(data) - _DIGEST_BYTES
    if body_end < len(MAGIC) + _HEADER_LENGTH.size or not data.startswith(MAGIC):
        raise SnapshotError("not a snapshot file (bad magic or truncated)")
    if hashlib.sha256(memoryview(data)[:body_end]).digest() != data[body_end:]:
        raise SnapshotError("checksum mismatch (damaged or truncated)")
    (header_length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
    header_start = len(MAGIC) + _HEADER_LENGTH.size
    payload = header_start + header_length
    try:
        header = json.loads(data[header_start:payload])
        database_id, generation = header["database_id"], header["generation"]
        index_kind, dimensions = header["index_kind"], header["dimensions"]
        owners = [(str(owner), int(size)) for owner, size in header["owners"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"bad header: {e}") from None
    if sum(size for _, size in owners) != body_end - payload:
        raise SnapshotError("header sizes do not match the file")
    indexes: dict[str, np.ndarray] = {}
    buffer = np.frombuffer(data, dtype=np.uint8)
    for owner, size in owners:
        indexes[owner] = buffer[payload : payload + size]
        payload += size
    return Snapshot(int(database_id), int(generation), str(index_kind), int(dimensions), indexes)


def fsync_directory(directory: Path) -> None:
    """Make a new or renamed entry in ``directory`` durable."""
    # A file's new name survives a power cut only once its directory is synced; not every platform
    # can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
