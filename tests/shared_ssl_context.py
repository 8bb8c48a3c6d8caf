"""One default SSL context for every httpx client the suite makes.

httpx builds a new SSL context for each Client (loading certifi's CA bundle: ~27 ms of CPU), and its
module-level ``httpx.get``/``httpx.post`` make a Client per call; so do the openai and anthropic clients
and schemathesis' calls. The suite makes thousands of them, all plain HTTP to 127.0.0.1, on two cores
shared with its servers. Clients asking for the default verification (``verify=True``, no client
certificate) now share one context per certificate environment; a test passing its own ``verify=``
context (the TLS tests) gets that one, as before.
"""

from __future__ import annotations

import os
import ssl
from typing import Any


def share_the_default_ssl_context() -> None:
    from httpx._transports import default  # where HTTPTransport looks create_ssl_context up

    make = getattr(default, "create_ssl_context", None)
    if make is None:  # another httpx: the suite runs as before, and test_shared_ssl_context.py says so
        return
    shared: dict[tuple[bool, str | None, str | None], ssl.SSLContext] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = make(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    default.create_ssl_context = create_ssl_context
