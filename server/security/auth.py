"""API-key authentication and caller identity.

Auth is off unless keys are configured (``--api-keys-file``, ``$PROTOSERVE_API_KEYS``;
admin keys, ``--admin-keys-file`` / ``$PROTOSERVE_ADMIN_KEYS``, are API keys too).
Each call carries its key as ``authorization: Bearer <key>`` metadata (or as
``x-api-key: <key>``, the way Anthropic's clients send it) and optionally an
``x-user-id``; there are no sessions.

The identity is HMAC-SHA256(server secret, len(key) ∥ key ∥ user_id) in hex
(server.security.identity_secret keeps the secret): the length prefix keeps ("ab", "c")
and ("a", "bc") apart, and the secret makes the hash worthless for guessing a
key offline. The identity owns the caller's requests (only it may cancel
them), its usage row, and its prefix-cache salt, so callers never share cached
KV or see each other's requests. With auth off the key is the empty string, so
users still get separate identities.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from protoserve.server import errors
from protoserve.server.limits import MAX_USER_ID_CHARS
from protoserve.server.security.identity_secret import load_identity_secret

API_KEYS_ENV = "PROTOSERVE_API_KEYS"
ADMIN_KEYS_ENV = "PROTOSERVE_ADMIN_KEYS"
USER_ID_HEADER = "x-user-id"
API_KEY_HEADER = "x-api-key"
_BEARER = "bearer "


@dataclass(frozen=True)
class Identity:
    """Who is calling: the hash that owns requests, usage and cached KV, and what it may see."""

    id: str  # HMAC-SHA256(secret, api_key ∥ user_id), hex
    user_id: str = ""
    # Whose rate limits the call counts against: the API key's (its identity without a user
    # id) when auth is on, since the key holder picks x-user-id freely; the identity itself
    # when auth is off, where the user id is the only name a caller has.
    quota_id: str = ""
    admin: bool = False  # an admin key: sees every identity's usage

    @property
    def cache_salt(self) -> bytes:
        """Prefix-cache salt: derived on the server, never taken from a request body."""
        return bytes.fromhex(self.id)


def identity_hash(secret: bytes, api_key: str, user_id: str) -> str:
    """HMAC-SHA256 of the (key, user id) pair under the server secret, hex; the key is length-prefixed."""
    key = api_key.encode("utf-8")
    message = len(key).to_bytes(8, "big") + key + user_id.encode("utf-8")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Authenticator:
    """Checks a call's API key (when auth is on) and derives its identity."""

    def __init__(
        self,
        api_keys: Iterable[str] | None = None,
        *,
        admin_keys: Iterable[str] | None = None,
        secret: bytes | None = None,
    ) -> None:
        """``secret`` None: a random one, so identities last as long as this object (tests, embedding)."""
        # Keep only digests: compare fixed-length values in constant time, and
        # hold no plain keys in memory longer than needed.
        self._admin_digests = [_digest(k) for k in (admin_keys or ())]
        self._digests = [_digest(k) for k in (api_keys or ())] + self._admin_digests
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    @classmethod
    def from_config(
        cls,
        api_keys_file: str | None,
        admin_keys_file: str | None = None,
        *,
        identity_secret_file: str | None = None,
        data_dir: str | None = None,
    ) -> Authenticator:
        """Keys from the files and ``$PROTOSERVE_API_KEYS`` / ``$PROTOSERVE_ADMIN_KEYS`` (none: auth off).

        The identity secret comes from server.security.identity_secret.load_identity_secret.
        Raises ValueError / OSError with a message fit for the command line.
        """
        return cls(
            load_api_keys(api_keys_file, os.environ.get(API_KEYS_ENV)),
            admin_keys=load_api_keys(admin_keys_file, os.environ.get(ADMIN_KEYS_ENV)),
            secret=load_identity_secret(identity_secret_file, data_dir),
        )

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def is_api_key(self, api_key: str) -> bool:
        """Whether ``api_key`` is accepted (any key when auth is off)."""
        return not self.enabled or self._matches(_digest(api_key), self._digests)

    def is_operator(self, identity: Identity) -> bool:
        """Whether ``identity`` may see how the server is set up (paths on its disk): an admin key's,
        or any caller's with auth off, where anyone may manage adapters too."""
        return identity.admin or not self.enabled

    def identity_for(self, api_key: str, user_id: str, *, admin: bool = False) -> Identity:
        """The identity of a key and user id (both may be empty), as a call with them would get."""
        identity = identity_hash(self._secret, api_key, user_id)
        quota = identity_hash(self._secret, api_key, "") if self.enabled else identity
        return Identity(id=identity, user_id=user_id, quota_id=quota, admin=admin)

    @staticmethod
    def _matches(digest: bytes, known: list[bytes]) -> bool:
        # Check every key so timing does not reveal which position matched.
        matched = False
        for candidate in known:
            matched |= hmac.compare_digest(digest, candidate)
        return matched

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Identity:
        """The caller's identity from its invocation metadata; UNAUTHENTICATED if the key is bad."""
        values: dict[str, str] = {}
        for key, value in metadata or ():
            if isinstance(value, bytes):
                continue  # binary headers (-bin) carry nothing we read
            values.setdefault(key.lower(), value)
        user_id = values.get(USER_ID_HEADER, "")
        if len(user_id) > MAX_USER_ID_CHARS:
            raise errors.invalid_argument(
                [(USER_ID_HEADER, f"must be at most {MAX_USER_ID_CHARS} characters, got {len(user_id)}")]
            )
        if not self.enabled:
            return self.identity_for("", user_id)
        api_key = _presented_key(values)
        digest = _digest(api_key)
        if not self._matches(digest, self._digests):
            raise errors.unauthenticated("invalid API key")
        return self.identity_for(api_key, user_id, admin=self._matches(digest, self._admin_digests))


def _presented_key(values: dict[str, str]) -> str:
    """The key a call presents: ``authorization: Bearer <key>``, else ``x-api-key: <key>``."""
    header = values.get("authorization", "")
    if header.lower().startswith(_BEARER):
        return header[len(_BEARER) :].strip()
    if header:
        # A key sent in another scheme (Basic, a bare key) would be dropped in favour of x-api-key.
        raise errors.unauthenticated("the authorization header must be 'Bearer <key>'")
    api_key = values.get(API_KEY_HEADER, "").strip()
    if not api_key:
        raise errors.unauthenticated(
            "missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>' metadata"
        )
    return api_key
