"""The suite's httpx clients share the default SSL context (tests/shared_ssl_context.py)."""

from __future__ import annotations

import ssl

import httpx


def _context(client: httpx.Client) -> ssl.SSLContext:
    return client._transport._pool._ssl_context  # type: ignore[attr-defined]


def test_default_clients_share_one_context_and_a_given_one_is_kept() -> None:
    with httpx.Client() as a, httpx.Client() as b:
        assert _context(a) is _context(b)
        assert _context(a).verify_mode == ssl.CERT_REQUIRED and _context(a).check_hostname
    own = ssl.create_default_context()
    with httpx.Client(verify=own) as c, httpx.Client(verify=False) as d:
        assert _context(c) is own
        assert _context(d).verify_mode == ssl.CERT_NONE
