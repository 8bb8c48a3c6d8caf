"""One persisted KV block as bytes: a header that names what it is, then its K/V, checksummed.

Layout (little-endian)::

    magic        8 bytes  b"PSKVBLK1"
    fingerprint 32 bytes  KVFingerprint.digest() of the engine that wrote it
    block hash  32 bytes  the block's chained hash (its name in the prefix cache)
    length       8 bytes  payload bytes
    checksum    32 bytes  sha256 of the payload
    payload               every layer's K block, then every layer's V block, raw

A file is loaded only when all of these agree with what the reader expects; anything else is recomputed.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s32s32sQ32s")
HEADER_BYTES = _HEADER.size


class BlockFileError(Exception):
    """The file is not a usable block: ``reason`` says why (for the warning)."""

    def __init__(self, reason: str, *, fingerprint_mismatch: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fingerprint_mismatch = fingerprint_mismatch


def encode_block(fingerprint: bytes, block_hash: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, fingerprint, block_hash, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_block(data: bytes, fingerprint: bytes, block_hash: bytes, payload_bytes: int) -> bytes:
    """The payload of ``data``; BlockFileError when it was written under another fingerprint, names
    another block, or is truncated or damaged."""
    if len(data) < HEADER_BYTES:
        raise BlockFileError(f"truncated header ({len(data)} bytes)")
    magic, file_fingerprint, file_hash, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("not a protoserve KV block file")
    if file_fingerprint != fingerprint:
        raise BlockFileError("written by another model configuration (fingerprint mismatch)",
                             fingerprint_mismatch=True)
    if file_hash != block_hash:
        raise BlockFileError("holds another block than its name says")
    payload = data[HEADER_BYTES:]
    if length != payload_bytes or len(payload) != payload_bytes:
        raise BlockFileError(f"payload is {len(payload)} bytes, expected {payload_bytes}")
    if hashlib.sha256(payload).digest() != checksum:
        raise BlockFileError("checksum mismatch (damaged)")
    return payload
