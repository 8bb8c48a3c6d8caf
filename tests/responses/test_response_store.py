"""ResponseStore: responses kept per owner, found by no other, bounded, and walked as conversations."""

from __future__ import annotations

import pytest

from protoserve.server.responses.store import (
    Bounds,
    MissingLink,
    ResponseStore,
    StoredItem,
    StoredResponse,
    StoreFull,
)

ALICE, BOB = "a" * 64, "b" * 64  # identities in partitions 10 and 11
SAME_PARTITION = "1" * 63 + "a"  # in Alice's partition (the last hex digit picks it), with none of her rows


def _response(response_id: str, previous: str | None = None, body: bytes = b"body") -> StoredResponse:
    items = (StoredItem(f"{response_id}-in0", b"first"), StoredItem(f"{response_id}-in1", b"second"))
    return StoredResponse(response_id, body, previous, 1.0, items)


@pytest.fixture
def store(tmp_path):
    store = ResponseStore(tmp_path / "responses")
    yield store
    store.close()


def test_an_owner_reads_its_response_and_no_other_owner_does(store):
    store.put(ALICE, ALICE, _response("resp_1"))
    assert store.get(ALICE, "resp_1") == _response("resp_1")
    for other in (BOB, SAME_PARTITION):
        assert store.get(other, "resp_1") is None
        assert store.chain(other, "resp_1") is None
        assert store.input_items(other, "resp_1", after=None, limit=20, descending=False) is None
        assert store.delete(other, "resp_1") is False
    assert store.get(ALICE, "resp_1") is not None


def test_input_items_page_in_either_order(store):
    store.put(ALICE, ALICE, _response("resp_1"))
    first = store.input_items(ALICE, "resp_1", after=None, limit=1, descending=True)
    assert [i.id for i in first.items] == ["resp_1-in1"] and first.has_more
    rest = store.input_items(ALICE, "resp_1", after="resp_1-in1", limit=1, descending=True)
    assert [i.id for i in rest.items] == ["resp_1-in0"] and not rest.has_more
    with pytest.raises(LookupError):
        store.input_items(ALICE, "resp_1", after="nope", limit=1, descending=False)


def test_a_chain_is_oldest_first_and_a_deleted_link_is_named(store):
    store.put(ALICE, ALICE, _response("resp_1"))
    store.put(ALICE, ALICE, _response("resp_2", "resp_1"))
    store.put(ALICE, ALICE, _response("resp_3", "resp_2"))
    assert [r.id for r in store.chain(ALICE, "resp_3")] == ["resp_1", "resp_2", "resp_3"]
    assert store.delete(ALICE, "resp_2")
    with pytest.raises(MissingLink) as gone:
        store.chain(ALICE, "resp_3")
    assert gone.value.response_id == "resp_2"


def test_bounds_count_owner_and_key_and_free_on_delete(tmp_path):
    size = _response("resp_1").size
    store = ResponseStore(tmp_path / "r", Bounds(owner_bytes=2 * size, key_bytes=3 * size))
    try:
        key = "c" * 64  # Alice and Bob under one API key
        store.put(ALICE, key, _response("resp_1"))
        store.put(ALICE, key, _response("resp_2"))
        with pytest.raises(StoreFull, match="identity"):
            store.check_room(ALICE, key, 1)
        store.put(BOB, key, _response("resp_3"))
        with pytest.raises(StoreFull, match="api key"):
            store.check_room(BOB, key, 1)
        store.delete(ALICE, "resp_1")
        store.check_room(BOB, key, 1)
        assert store.key_use(key) == 2 * size
    finally:
        store.close()


def test_key_totals_survive_a_reopen(tmp_path):
    store = ResponseStore(tmp_path / "r")
    store.put(ALICE, "d" * 64, _response("resp_1"))
    store.close()
    reopened = ResponseStore(tmp_path / "r")
    try:
        assert reopened.key_use("d" * 64) == _response("resp_1").size
        assert reopened.get(ALICE, "resp_1") is not None
    finally:
        reopened.close()
