"""Incremental detokenization: token ids in, text out, never a broken UTF-8 character.

Text is built from each token's raw bytes (byte-level BPE tokens may hold part
of a character). An incremental UTF-8 decoder keeps the bytes of an unfinished
character until the tokens that complete it arrive, and only at the end turns
leftovers into U+FFFD, as a full ``bytes.decode(errors="replace")`` would.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    """Decodes one choice's tokens as they are generated."""

    def __init__(self, token_bytes: Callable[[int], bytes], skip_token_ids: frozenset[int] = frozenset()) -> None:
        self._token_bytes = token_bytes
        self._skip = skip_token_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a character is unfinished)."""
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._token_bytes(token_id), final=False)

    def flush(self) -> str:
        """At the end of the stream: unfinished bytes become U+FFFD."""
        return self._decoder.decode(b"", final=True)
