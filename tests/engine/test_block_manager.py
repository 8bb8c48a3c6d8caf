"""BlockManager: reference counts, prefix cache, eviction — unit tests and a hypothesis state machine."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protoserve.engine.scheduling.block_manager import BlockManager, block_hash, chain_hashes, root_hash

BS = 4


def test_chain_hash_depends_on_salt_prefix_and_tokens():
    a = chain_hashes(b"", [1, 2, 3, 4, 5, 6, 7, 8], BS, [])
    assert len(a) == 2
    assert chain_hashes(b"x", [1, 2, 3, 4, 5, 6, 7, 8], BS, []) != a
    b = chain_hashes(b"", [9, 2, 3, 4, 5, 6, 7, 8], BS, [])
    assert b[1] != a[1], "block 1 has the same tokens but a different prefix"
    assert a[0] == block_hash(root_hash(b""), [1, 2, 3, 4])
    # Partial blocks get no hash; extending reuses the known ones.
    known = chain_hashes(b"", [1, 2, 3, 4, 5], BS, [])
    assert len(known) == 1
    assert chain_hashes(b"", [1, 2, 3, 4, 5, 6, 7, 8], BS, known) == a


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS)
    t1: list[int] = []
    assert bm.allocate(t1, 9)  # 3 blocks
    t2: list[int] = []
    assert not bm.allocate(t2, 8)
    assert t2 == [] and bm.num_free_blocks == 1
    bm.free(t1)
    assert bm.num_free_blocks == 4 and t1 == []


def test_prefix_hit_revives_freed_block_and_eviction_drops_it():
    bm = BlockManager(3, BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = chain_hashes(b"", tokens, BS, [])
    t: list[int] = []
    bm.allocate(t, 8)
    for b, h in zip(t, hashes, strict=True):
        bm.cache_block(b, h)
    first = list(t)
    bm.free(t)
    assert bm.num_free_blocks == 3  # cached blocks count as free
    assert bm.match_prefix(hashes) == first
    assert bm.match_prefix(chain_hashes(b"salt", tokens, BS, [])) == []
    t2: list[int] = []
    assert bm.allocate(t2, 12, bm.match_prefix(hashes))
    assert t2[:2] == first
    bm.free(t2)
    # Filling the pool with something else evicts the cached blocks (LRU: the uncached one goes first).
    t3: list[int] = []
    assert bm.allocate(t3, 12)
    assert bm.match_prefix(hashes) == []
    bm.free(t3)
    assert bm.num_free_blocks == 3


def test_fork_shares_blocks_by_reference():
    bm = BlockManager(6, BS)
    parent: list[int] = []
    bm.allocate(parent, 10)
    child = bm.fork(parent, 2)
    assert child == parent[:2]
    assert [bm.blocks[b].ref_count for b in parent] == [2, 2, 1]
    bm.free(parent)
    assert bm.num_free_blocks == 4  # the shared two are still held by the child
    bm.free(child)
    assert bm.num_free_blocks == 6


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences of allocate / append / fork / prefix hit / free, with a shadow of block contents.

    The shadow records which (salt, token prefix) each block's K/V would hold; a
    prefix hit must always hand out a block whose contents match, however many
    evictions happened in between.
    """

    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS)
        self.seqs: list[dict] = []  # {"table", "tokens", "salt", "hashes", "cached"}
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.hits = 0

    def _compute(self, seq: dict, start: int) -> None:
        """Pretend a forward wrote tokens[start:]: record contents, publish full blocks."""
        tokens = seq["tokens"]
        for b in range(start // BS, len(seq["table"])):
            end = min((b + 1) * BS, len(tokens))
            self.content[seq["table"][b]] = (seq["salt"], tuple(tokens[:end]))
        hashes = chain_hashes(seq["salt"], tokens, BS, seq["hashes"])
        for b in range(seq["cached"], len(tokens) // BS):
            self.bm.cache_block(seq["table"][b], hashes[b])
        seq["cached"] = len(tokens) // BS

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14),
        salt=st.sampled_from([b"", b"tenant-b"]),
    )
    def admit(self, tokens, salt):
        seq = {"table": [], "tokens": list(tokens), "salt": salt, "hashes": [], "cached": 0}
        hashes = chain_hashes(salt, tokens, BS, seq["hashes"])
        hits = self.bm.match_prefix(hashes[: (len(tokens) - 1) // BS])
        for i, b in enumerate(hits):
            assert self.content[b] == (salt, tuple(tokens[: (i + 1) * BS])), "prefix hit with wrong contents"
        if self.bm.allocate(seq["table"], len(tokens), hits):
            self.hits += len(hits)
            seq["cached"] = len(hits)
            self._compute(seq, len(hits) * BS)
            self.seqs.append(seq)
        else:
            assert seq["table"] == []

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(self.seqs))
        start = len(seq["tokens"])
        if self.bm.allocate(seq["table"], start + len(new)):
            seq["tokens"] += new
            self._compute(seq, start)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def fork(self, data, token):
        parent = data.draw(st.sampled_from(self.seqs))
        shared = len(parent["tokens"]) // BS
        table = self.bm.fork(parent["table"], shared)
        child = {
            "table": table,
            "tokens": parent["tokens"][: shared * BS] + [token],
            "salt": parent["salt"],
            "hashes": parent["hashes"][:shared],
            "cached": min(parent["cached"], shared),
        }
        if self.bm.allocate(child["table"], len(child["tokens"])):
            self._compute(child, shared * BS)
            self.seqs.append(child)
        else:
            self.bm.free(child["table"])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq["table"])

    @invariant()
    def refcounts_match_tables(self):
        refs = [0] * self.NUM_BLOCKS
        for seq in self.seqs:
            assert len(seq["table"]) == -(-len(seq["tokens"]) // BS)
            assert len(set(seq["table"])) == len(seq["table"])
            for b in seq["table"]:
                refs[b] += 1
        for block in self.bm.blocks:
            assert block.ref_count == refs[block.block_id]
            assert (block.block_id in self.bm.free_queue) == (block.ref_count == 0)
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].hash == h

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq["table"])
        assert self.bm.num_free_blocks == self.NUM_BLOCKS
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
