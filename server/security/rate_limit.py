"""Per-caller rate limits: requests and tokens per minute, each a token bucket.

A bucket holds up to one minute's allowance and refills continuously, so a
caller may burst up to its per-minute limit and then proceeds at the steady
rate. Limits count against the caller's quota id (server.security.auth.Identity): the
API key when auth is on, the user id when it is off.

* Requests: every generating call takes one (each item of a Batch is a call).
* Tokens: each engine request reserves its prompt tokens plus ``max_tokens``
  per choice (the rest of the context window when max_tokens is unset) before
  it runs, and gives back what it did not use when it ends, however it ends.
  A request that can never fit (more than the per-minute limit) is refused
  without RetryInfo, since waiting would not help.
* Embedding work (Embed, OpenAI embeddings, RAG index and search) takes one
  request per call, and the tokens it embeds (every input's; every chunk's,
  overlaps included; the query's) once they are counted and before the model
  runs (``charge_tokens``): nothing comes back, the work is known in advance.
  Retrieve-and-generate's query counts too, beside its generation's reservation.

A refusal is RESOURCE_EXHAUSTED with reason RATE_LIMIT_EXCEEDED and a RetryInfo
delay: the time until the bucket holds enough (the gateway's 429 Retry-After).

Defaults come from ``--rate-limit-rpm`` / ``--rate-limit-tpm`` (0: no limit);
``--rate-limits-file`` overrides them per API key, in TOML::

    [keys."sk-team-a"]
    rpm = 600
    tpm = 200000        # a field left out keeps the server default; 0 lifts that limit
    weight = 2          # its share of the engine when keys compete (engine fair scheduling) [1]
    rag_max_documents = 50000   # RAG quotas of the key over all its user ids [--rag-key-max-*]
    rag_max_bytes = 1073741824

The buckets are in memory, per process; time comes from an injectable clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from protoserve.server.errors import ServiceError
from protoserve.v1 import inference_pb2

if TYPE_CHECKING:
    from protoserve.engine.api import TokenizedRequest
    from protoserve.server.security.auth import Authenticator, Identity

# A bucket refills from empty in one minute, so one untouched that long is full:
# dropping it loses nothing, and callers that come and go cannot grow the table.
_IDLE_S = 60.0


@dataclass(frozen=True)
class Limits:
    """Allowances per minute (0 means no limit), and the key's weight in the engine's fair scheduling."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute: prompt plus generated, reserved as prompt + max_tokens per choice
    # While keys compete for the engine, each is served in proportion to its weight (a whole number >= 1).
    weight: int = 1
    # The key's RAG quotas over all its identities (0: no limit); None: the server's --rag-key-max-*.
    rag_max_documents: int | None = None
    rag_max_bytes: int | None = None


class TokenBucket:
    """Up to ``capacity`` units, refilled at ``rate`` per second; every method takes the time ``now``."""

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken: 0 now, ``inf`` if it exceeds the capacity."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return :meth:`wait_s`."""
        wait = self.wait_s(amount, now)
        if wait == 0.0:
            self.level -= amount
        return wait

    def give(self, amount: float, now: float) -> None:
        """Return ``amount`` (never above the capacity); a negative amount charges more than was taken."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


def reserved_tokens(request: TokenizedRequest, max_model_len: int) -> int:
    """What an engine request may use: its prompt plus max_tokens (else the rest of the context) per choice."""
    prompt = len(request.prompt_token_ids)
    per_choice = request.sampling.max_tokens
    if per_choice is None:
        per_choice = max(0, max_model_len - prompt)
    return prompt + per_choice * request.sampling.n


@dataclass
class Reservation:
    """Tokens an engine request holds from its caller's bucket until it ends."""

    quota_id: str
    tokens: int


def rate_limited(what: str, limit: int, requested: int, retry_after_s: float | None) -> ServiceError:
    """RESOURCE_EXHAUSTED for a refused call; no RetryInfo when waiting cannot help."""
    if retry_after_s is None:
        message = (
            f"this request needs {requested} {what}, more than the limit of {limit} {what} per minute; "
            "lower max_tokens (or n), or shorten the prompt"
        )
    else:
        message = f"rate limit of {limit} {what} per minute exceeded; retry in {retry_after_s:.1f} s"
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        inference_pb2.ERROR_REASON_RATE_LIMIT_EXCEEDED,
        message,
        retry_after_s=retry_after_s,
        metadata={"limit": f"{what}_per_minute", "limit_value": str(limit), "requested": str(requested)},
    )


class RateLimiter:
    """The buckets of every quota id; used on the event loop only."""

    def __init__(
        self,
        default: Limits = Limits(),
        overrides: Mapping[str, Limits] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``overrides`` are keyed by quota id (server.security.auth.Identity.quota_id)."""
        self.default = default
        self.overrides = dict(overrides or {})
        self._clock = clock
        self._buckets: OrderedDict[tuple[str, str], TokenBucket] = OrderedDict()

    @classmethod
    def from_config(
        cls, rpm: int | None, tpm: int | None, limits_file: str | None, auth: Authenticator
    ) -> RateLimiter:
        """The flags' defaults and the file's per-key overrides; ValueError / OSError for bad settings."""
        default = Limits(rpm=rpm or 0, tpm=tpm or 0)
        for flag, value in (("--rate-limit-rpm", default.rpm), ("--rate-limit-tpm", default.tpm)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0 (0: no limit), got {value}")
        overrides: dict[str, Limits] = {}
        if limits_file is not None:
            if not auth.enabled:
                raise ValueError("--rate-limits-file sets limits per API key, so it needs auth (--api-keys-file)")
            by_key = load_key_limits(limits_file, default)
            unknown = sum(1 for api_key in by_key if not auth.is_api_key(api_key))
            if unknown:
                # Never the key itself: it may be a real secret with a typo.
                raise ValueError(f"{limits_file}: {unknown} of its keys are not API keys of this server")
            overrides = {auth.identity_for(key, "").quota_id: limits for key, limits in by_key.items()}
        return cls(default, overrides)

    @property
    def enabled(self) -> bool:
        return any(limits.rpm or limits.tpm for limits in (self.default, *self.overrides.values()))

    def limits(self, identity: Identity) -> Limits:
        return self.overrides.get(identity.quota_id, self.default)

    def _bucket(self, quota_id: str, kind: str, per_minute: int, now: float) -> TokenBucket:
        while self._buckets:
            oldest_key, oldest = next(iter(self._buckets.items()))
            if now - oldest.updated < _IDLE_S:
                break
            del self._buckets[oldest_key]
        key = (quota_id, kind)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(per_minute, per_minute / 60.0, now)
        self._buckets.move_to_end(key)
        return bucket

    def admit_request(self, identity: Identity) -> None:
        """Count one request against the caller; RESOURCE_EXHAUSTED with RetryInfo if over its rpm."""
        rpm = self.limits(identity).rpm
        if not rpm:
            return
        now = self._clock()
        wait = self._bucket(identity.quota_id, "requests", rpm, now).take(1, now)
        if wait:
            raise rate_limited("requests", rpm, 1, wait)

    def reserve_tokens(self, identity: Identity, tokens: int) -> Reservation | None:
        """Hold ``tokens`` of the caller's tpm until :meth:`release`; None when it has no tpm limit."""
        tpm = self.limits(identity).tpm
        if not tpm:
            return None
        now = self._clock()
        wait = self._bucket(identity.quota_id, "tokens", tpm, now).take(tokens, now)
        if wait == math.inf:
            raise rate_limited("tokens", tpm, tokens, None)
        if wait:
            raise rate_limited("tokens", tpm, tokens, wait)
        return Reservation(identity.quota_id, tokens)

    def charge_tokens(self, identity: Identity, tokens: int) -> None:
        """Take ``tokens`` of the caller's tpm for work whose size is known before it runs (embedding);
        RESOURCE_EXHAUSTED as :meth:`reserve_tokens` when the bucket lacks them. Nothing is given back."""
        self.reserve_tokens(identity, tokens)

    def release(self, reservation: Reservation | None, used: int) -> None:
        """End a reservation: the tokens not used go back to the caller's bucket."""
        if reservation is None:
            return
        bucket = self._buckets.get((reservation.quota_id, "tokens"))
        if bucket is not None:
            # A bucket dropped meanwhile was full again: nothing to give back.
            bucket.give(reservation.tokens - used, self._clock())


_KEY_FIELDS = ("rpm", "tpm", "weight", "rag_max_documents", "rag_max_bytes")


def load_key_limits(path: str | Path, default: Limits = Limits()) -> dict[str, Limits]:
    """``{api_key: Limits}`` from a TOML file of ``[keys."<key>"]`` tables of :class:`Limits` fields.

    Error messages name the file and the entry's position, never the key.
    """
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    extra = sorted(set(document) - {"keys"})
    if extra:
        raise ValueError(f"{path}: unknown top-level entries {extra}; per-key limits go in [keys.\"<key>\"] tables")
    keys = document.get("keys", {})
    if not isinstance(keys, dict):
        raise ValueError(f"{path}: 'keys' must be a table of [keys.\"<key>\"] tables")
    limits: dict[str, Limits] = {}
    for position, (api_key, entry) in enumerate(keys.items(), start=1):
        where = f"{path}: entry {position} of [keys]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a table of some of {', '.join(_KEY_FIELDS)}")
        unknown = sorted(set(entry) - set(_KEY_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; only {', '.join(_KEY_FIELDS)}")
        for name, value in entry.items():
            least = 1 if name == "weight" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{where}: {name} must be a whole number >= {least}")
        limits[api_key] = dataclasses.replace(default, **entry)
    return limits
