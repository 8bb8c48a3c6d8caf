"""API-key authentication and caller identity.

Auth is off unless keys are configured. Each call carries its key as
``authorization: Bearer <key>`` metadata and optionally an ``x-user-id``; there
are no sessions. The identity, sha256(api_key ∥ user_id) in hex, owns the
caller's requests (only it may cancel them), its usage, and its prefix-cache
salt, so callers never share cached KV or see each other's requests. With auth
off the key is the empty string, so users still get separate identities.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from server import errors

API_KEYS_ENV = "PROTOSERVE_API_KEYS"
USER_ID_HEADER = "x-user-id"
_BEARER = "bearer "


@dataclass(frozen=True)
class Identity:
    """Who is calling: the hash that owns requests, usage and cached KV."""

    id: str  # sha256(api_key ∥ user_id), hex
    user_id: str = ""

    @property
    def cache_salt(self) -> bytes:
        """Prefix-cache salt: derived on the server, never taken from a request body."""
        return bytes.fromhex(self.id)


def identity_for(api_key: str, user_id: str) -> Identity:
    """The identity of a key and user id (both may be empty)."""
    digest = hashlib.sha256((api_key + user_id).encode("utf-8")).hexdigest()
    return Identity(id=digest, user_id=user_id)


def load_api_keys(path: str | os.PathLike[str] | None = None, env: str | None = None) -> list[str]:
    """Keys from a file (one per line; blank lines and # comments ignored) and/or a comma list."""
    keys: list[str] = []
    if path is not None:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if env:
        keys.extend(k.strip() for k in env.split(",") if k.strip())
    return keys


class Authenticator:
    """Checks a call's API key (when auth is on) and derives its identity."""

    def __init__(self, api_keys: Iterable[str] | None = None) -> None:
        # Keep only digests: compare fixed-length values in constant time, and
        # hold no plain keys in memory longer than needed.
        self._digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in (api_keys or ())]

    @classmethod
    def from_config(cls, api_keys_file: str | None) -> Authenticator:
        """Keys from ``--api-keys-file`` and ``$PROTOSERVE_API_KEYS``; no keys means auth off."""
        return cls(load_api_keys(api_keys_file, os.environ.get(API_KEYS_ENV)))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Identity:
        """The caller's identity from its invocation metadata; UNAUTHENTICATED if the key is bad."""
        values: dict[str, str] = {}
        for key, value in metadata or ():
            if isinstance(value, bytes):
                continue  # binary headers (-bin) carry nothing we read
            values.setdefault(key.lower(), value)
        user_id = values.get(USER_ID_HEADER, "")
        if not self.enabled:
            return identity_for("", user_id)
        header = values.get("authorization", "")
        if not header.lower().startswith(_BEARER):
            raise errors.unauthenticated("missing API key: send 'authorization: Bearer <key>' metadata")
        api_key = header[len(_BEARER) :].strip()
        digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        # Check every key so timing does not reveal which position matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        if not matched:
            raise errors.unauthenticated("invalid API key")
        return identity_for(api_key, user_id)
