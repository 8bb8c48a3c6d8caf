"""The fuzz suite's server: its own, with a small context, so no generated request runs long.

The fuzzers send whatever their schemas allow, ``max_tokens`` in the billions
included; with a 128-token context every request ends within about a second
(or is refused for its length), which keeps the suite bounded in time.
"""

from __future__ import annotations

import pytest
from fuzz_support import FUZZ_CONTEXT_TOKENS


@pytest.fixture(scope="session")
def fuzz_server(spawn_server):
    """``protoserve serve`` with the gateway, auth off, a 128-token context: for the fuzzers alone."""
    return spawn_server("--max-model-len", str(FUZZ_CONTEXT_TOKENS), for_session=True)
