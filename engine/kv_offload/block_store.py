"""BlockStore: persisted KV blocks under one directory, at most ``max_bytes`` of them, least recently used
out first.

Layout under ``root``::

    <fingerprint>/                      one model configuration's blocks (fingerprint.py), 16 hex digits
      partition-<key>/                  one cache salt's (identity's) blocks; <key> derives from the salt
        <block hash>.kv                 one block (block_file.py)

The directory of a partition is named from a digest of the salt the engine is given, never from anything
a caller sends, and a block's file from its chained hash, which the salt starts: a caller can neither
name another's directory nor compute another's block names. Files of other fingerprints stay on disk
(another server may use them) and count against the cap, but are never read.

The index of files (and their LRU order) lives in memory, scanned once at start; reads and writes run
on the offloader's one worker thread, index lookups on the step thread, under a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from protoserve.engine.kv_offload.block_file import BlockFileError, decode_block, encode_block

log = logging.getLogger(__name__)

SUFFIX = ".kv"


def partition_name(salt: bytes) -> str:
    """The directory of one cache salt's blocks."""
    return "partition-" + hashlib.sha256(b"protoserve-kv-partition\x00" + salt).hexdigest()[:32]


class BlockStore:
    def __init__(self, root: str | os.PathLike[str], fingerprint: bytes, max_bytes: int, payload_bytes: int) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.payload_bytes = payload_bytes
        self.dir = self.root / fingerprint.hex()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir {str(root)!r} cannot hold blocks: {exc.strerror or exc}") from None
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # every block file under root, oldest use first
        self._bytes = 0
        self._scan()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def path(self, salt: bytes, block_hash: bytes) -> Path:
        return self.dir / partition_name(salt) / (block_hash.hex() + SUFFIX)

    def contains(self, path: Path) -> bool:
        with self._lock:
            return path in self._files

    def write(self, path: Path, block_hash: bytes, payload: bytes) -> None:
        """Store one block (atomically: a reader sees the old file or the new one), then evict to the cap."""
        data = encode_block(self.fingerprint, block_hash, payload)
        if len(data) > self.max_bytes:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._bytes += len(data) - self._files.pop(path, 0)
            self._files[path] = len(data)
            victims = self._over_cap()
        for victim in victims:
            victim.unlink(missing_ok=True)

    def read(self, path: Path, block_hash: bytes) -> bytes | None:
        """The block's payload, or None (with a warning when the file exists but cannot be used: it is
        deleted, so the block is recomputed and written anew)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted by another server sharing the directory
            self._forget(path)
            return None
        except OSError as exc:  # unreadable: the tokens are computed instead, the request never fails
            log.warning("kv offload: cannot read block file %s (%s); recomputing its tokens", path, exc)
            self._forget(path)
            return None
        try:
            payload = decode_block(data, self.fingerprint, block_hash, self.payload_bytes)
        except BlockFileError as exc:
            log.warning("kv offload: block file %s %s; recomputing its tokens", path, exc.reason)
            self._forget(path)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        with contextlib.suppress(OSError):  # the LRU order of the next start; gone already is fine
            os.utime(path)
        return payload

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._bytes -= self._files.pop(path, 0)

    def _over_cap(self) -> list[Path]:
        """Take the least recently used files out of the index until the rest fit the cap (lock held)."""
        victims = []
        while self._bytes > self.max_bytes and self._files:
            path, size = self._files.popitem(last=False)
            self._bytes -= size
            victims.append(path)
        return victims

    def _scan(self) -> None:
        found = []
        for path in self.root.glob(f"*/partition-*/*{SUFFIX}"):
            stat = path.stat()
            found.append((stat.st_mtime_ns, path, stat.st_size))
        for tmp in self.root.glob("*/partition-*/*.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        found.sort()
        foreign = 0
        for _, path, size in found:
            self._files[path] = size
            self._bytes += size
            foreign += path.parent.parent != self.dir
        if foreign:
            log.warning("kv offload: %d block files in %s were written under another model configuration "
                        "(checkpoint, dtype, quantization, KV dtype or activation precision): none is loaded, "
                        "their tokens are recomputed", foreign, self.root)
        for victim in self._over_cap():
            victim.unlink(missing_ok=True)
