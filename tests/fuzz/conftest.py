"""The fuzz suite's server: its own, with a small context, so no generated request runs long.

The fuzzers send whatever their schemas allow, ``max_tokens`` in the billions
included; with a 128-token context every request ends within about a second
(or is refused for its length), which keeps the suite bounded in time.
"""

from __future__ import annotations

import pytest
from _pytest.nodeid import coerce_node_id
from fuzz_support import FUZZ_CONTEXT_TOKENS


@pytest.fixture(scope="session")
def fuzz_server(spawn_server):
    """``protoserve serve`` with the gateway, auth off, a 128-token context: for the fuzzers alone."""
    return spawn_server("--max-model-len", str(FUZZ_CONTEXT_TOKENS), for_session=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each operation schemathesis parametrizes a node id of its own.

    Under pytest 9 its items all share the test function's node id (only their names carry the
    operation, as ``test[POST /v1/completions]``). pytest-xdist, which ``make test`` runs, schedules
    by node id: it ran one operation of the 54 and dropped the rest without a word (tests/conftest.py
    now refuses a collection with two items of one id).
    """
    for item in items:
        operation = item.name.partition("[")[2].removesuffix("]")
        if operation and not item.nodeid.endswith("]"):
            item._id = coerce_node_id(f"{item.nodeid}[{operation}]")  # pytest keeps no public setter
