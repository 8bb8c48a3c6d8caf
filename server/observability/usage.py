"""Per-identity usage: requests finished and tokens in and out.

The identity (not the user id) is the key, so the count cannot be spoofed by
a request body; the metrics service reads these totals, each caller only its
own unless it has an admin key (server.services.metrics_service).

Input tokens include the tokens a caller had embedded (Embed, OpenAI embeddings,
RAG index and search, a retrieve-and-generate's query), as OpenAI counts an
embedding's input as prompt tokens; each embedding call is a request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class IdentityUsage:
    """Totals of one identity."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class UsageLedger:
    """Usage totals by identity id; safe to read from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[str, IdentityUsage] = {}

    def record(self, identity_id: str, input_tokens: int, output_tokens: int, requests: int = 1) -> None:
        """Add a finished request's tokens; ``requests=0`` adds tokens to a request counted elsewhere."""
        with self._lock:
            usage = self._usage.setdefault(identity_id, IdentityUsage())
            usage.requests += requests
            usage.input_tokens += input_tokens
            usage.output_tokens += output_tokens

    def snapshot(self, identity_id: str | None = None) -> dict[str, IdentityUsage]:
        """Every identity's totals, or only ``identity_id``'s (empty until it has any)."""
        with self._lock:
            if identity_id is None:
                rows = self._usage.items()
            else:
                rows = [(identity_id, self._usage[identity_id])] if identity_id in self._usage else []
            return {k: IdentityUsage(v.requests, v.input_tokens, v.output_tokens) for k, v in rows}
