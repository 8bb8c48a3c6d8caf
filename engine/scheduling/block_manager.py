"""BlockManager: a pool of fixed-size KV blocks with reference counts and a prefix cache.

A sequence's KV lives in the blocks its block table lists, in order. Blocks are
shared by reference count: ``n > 1`` samples fork the prompt's blocks, and the
prefix cache hands the same full block to every sequence whose tokens (and
cache salt) up to and including that block are identical.

A full block is named by a chained hash: ``hash_i = H(hash_{i-1}, tokens of block i)``
with ``hash_{-1} = H(salt)``, so one name fixes the block's tokens *and* everything
before them (which is what its K/V depend on), and two salts never share a name.

Free blocks sit in one LRU queue. A freed block that carries a hash keeps it and
its cache entry until the pool needs the block for something else, so a later
request can revive it; blocks without a hash go to the front to be reused first.
An ``on_evict`` callback sees a cached block just before its contents are given up
(engine/kv_offload writes it to disk there), and ``adopt`` publishes a block whose
K/V were loaded from elsewhere as if it had been computed and freed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(salt: bytes) -> bytes:
    """The chain's start: salting here propagates to every block hash after it."""
    return hashlib.sha256(b"protoserve-kv-root\x00" + salt).digest()


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Name of a full block: its parent's name and its own tokens (sha256, so collisions are not a concern)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def chain_hashes(salt: bytes, token_ids: Seq[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extend ``known`` (hashes of the first full blocks) to cover every full block of ``token_ids``."""
    parent = known[-1] if known else root_hash(salt)
    for i in range(len(known), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        known.append(parent)
    return known


@dataclass
class Block:
    """One KV block's bookkeeping: who references it and, when full and cached, its name."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    salt: bytes = b""  # the cache salt its hash chain started from (set with the hash)


class BlockManager:
    """Allocates, shares and frees KV blocks; all state is integer ids and counts."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front first); values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Called with (block id, hash, salt) before a cached block is evicted; its K/V are still intact.
        self.on_evict: Callable[[int, bytes, bytes], None] | None = None

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, including cached ones that may still be revived."""
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def match_prefix(self, hashes: Seq[bytes]) -> list[int]:
        """Ids of the cached blocks for the longest prefix of ``hashes``; takes no references."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- mutations -----------------------------------------------------------

    def allocate(self, block_table: list[int], num_tokens: int, prefix_hits: Seq[int] = ()) -> bool:
        """Grow ``block_table`` so it holds ``num_tokens`` tokens; all or nothing.

        ``prefix_hits`` (only for an empty table) are cached blocks to reuse as the
        table's first entries: they are referenced before any new block is taken so
        eviction cannot pick them.
        """
        assert not prefix_hits or not block_table, "prefix hits only start an empty table"
        if not prefix_hits and num_tokens <= len(block_table) * self.block_size:
            return True  # a decode row inside its last block: every step, for most rows
        if self._blocks_to_take(block_table, num_tokens, prefix_hits) > len(self.free_queue):
            return False
        for block_id in prefix_hits:
            self._ref(block_id)
            block_table.append(block_id)
        for _ in range(self.blocks_for(num_tokens) - len(block_table)):
            block_table.append(self._take_free())
        return True

    def fork(self, block_table: Seq[int], num_blocks: int) -> list[int]:
        """A new table sharing the first ``num_blocks`` blocks of ``block_table`` (one more reference each)."""
        shared = list(block_table[:num_blocks])
        for block_id in shared:
            self._ref(block_id)
        return shared

    def free(self, block_table: list[int]) -> None:
        """Drop the table's references, last block first, and empty it.

        Reverse order puts a sequence's tail blocks ahead of its head blocks in
        the eviction queue: heads are the ones other prompts are likely to share.
        """
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        block_table.clear()

    def truncate(self, block_table: list[int], num_blocks: int) -> None:
        """Drop the table's blocks past the first ``num_blocks`` (speculative rollback: their K/V are
        of rejected drafts, and a block past a sequence's final tokens never carries a hash)."""
        tail = block_table[num_blocks:]
        if tail:
            del block_table[num_blocks:]
            self.free(tail)

    def cache_block(self, block_id: int, h: bytes, salt: bytes = b"") -> None:
        """Publish a full, computed block under its hash so later prefixes can reuse it.

        When another block already holds this hash (two sequences computed the same
        prefix at once) the first one stays the cached copy.
        """
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.hash is not None or h in self.cached:
            return
        block.hash = h
        block.salt = salt
        self.cached[h] = block_id

    def touch(self, block_ids: Seq[int]) -> None:
        """Make the free ones among ``block_ids`` the most recently used, last evicted, in order."""
        for block_id in block_ids:
            if block_id in self.free_queue:
                self.free_queue.move_to_end(block_id)

    def adopt(self, h: bytes, salt: bytes) -> int | None:
        """A block to load the K/V of cached block ``h`` into: published under ``h`` and left free (most
        recently used), as if computed and released. None when ``h`` is cached already or nothing is free."""
        if not self.enable_prefix_caching or h in self.cached or not self.free_queue:
            return None
        block_id = self._take_free()
        block = self.blocks[block_id]
        block.ref_count = 0
        block.hash = h
        block.salt = salt
        self.cached[h] = block_id
        self.free_queue[block_id] = None
        return block_id

    # -- internals -----------------------------------------------------------

    def _blocks_to_take(self, block_table: Seq[int], num_tokens: int, prefix_hits: Seq[int]) -> int:
        # Cached hits that nobody references sit in the free queue: reviving them uses it up too.
        revived = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)
        new = max(0, self.blocks_for(num_tokens) - len(block_table) - len(prefix_hits))
        return new + revived

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its old contents are about to be overwritten
            if self.on_evict is not None:
                self.on_evict(block_id, block.hash, block.salt)
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
