"""Requests in flight: who owns them, how they end, and when the server is idle.

Every API call that generates opens a :class:`Call` here. The call owns the
engine requests it starts, so

* the Cancel RPC can find them, but only for the identity that started them;
* leaving the call for any reason (the client went away, an error, the handler
  finished) closes their engine generators, which aborts them in the engine and
  frees their KV cache;
* a deadline aborts them when it passes, even if gRPC has not cancelled the
  handler yet;
* shutdown can stop admitting calls and wait for the running ones to finish.

Each call is one request for accounting: it carries a RequestRecord that its
engine requests fill in, and when it ends (however it ends) its usage goes to
the ledger and the record to telemetry (metrics and the request log).

Rate limits (server.security.rate_limit) are charged here, where every generating RPC
passes: opening a call takes one request (so each Batch item counts), and each
engine request holds its token reservation while it runs. Here too every engine
request is stamped with its tenant (the caller's identity, its API key and the key's
weight), which the engine's fair scheduling shares the engine by.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protoserve.engine.api import FinishReason, RequestOutput, RequestStats, Tenant, TokenizedRequest
from protoserve.server import errors
from protoserve.server.calls.request_record import RequestRecord
from protoserve.server.calls.request_scope import current_scope
from protoserve.server.observability.usage import UsageLedger
from protoserve.server.security.auth import Identity
from protoserve.server.security.rate_limit import RateLimiter, reserved_tokens

if TYPE_CHECKING:
    from protoserve.engine.runtime import AsyncEngine
    from protoserve.server.observability.telemetry import Telemetry

# How many finished (identity, request id) pairs to remember so that a late
# Cancel answers cancelled=false instead of NOT_FOUND.
_FINISHED_MEMORY = 4096


@dataclass
class Call:
    """One API call and the engine requests it runs."""

    identity: Identity
    public_id: str
    deadline: float | None  # event-loop time, or None
    record: RequestRecord
    engine_requests: dict[str, AsyncEngine] = field(default_factory=dict)
    generators: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    cancelled: bool = False

    def abort(self) -> bool:
        """Abort every engine request of the call; True if any was still running."""
        self.cancelled = True
        return any([engine.abort(rid) for rid, engine in list(self.engine_requests.items())])


class InflightRequests:
    """The registry of running calls, keyed by (identity, public request id)."""

    def __init__(
        self, usage: UsageLedger, telemetry: Telemetry | None = None, limiter: RateLimiter | None = None
    ) -> None:
        self.usage = usage
        self.telemetry = telemetry
        self.limiter = limiter
        self._calls: dict[tuple[str, str], Call] = {}
        self._finished: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True

    def __len__(self) -> int:
        return len(self._calls)

    @contextlib.asynccontextmanager
    async def call(self, identity: Identity, public_id: str, deadline: float | None) -> AsyncIterator[Call]:
        """Open a call; on exit every engine request it started is closed (and so aborted)."""
        record = self._new_record(identity, public_id)
        key = (identity.id, public_id)
        try:
            if not self._accepting:
                raise errors.draining()
            if key in self._calls:
                raise errors.invalid_argument(
                    [("request_id", f"{public_id!r} is already in use by a running request")]
                )
            if self.limiter is not None:
                self.limiter.admit_request(identity)
        except errors.ServiceError as exc:
            self._finish(record, exc, deadline)
            raise
        call = Call(identity, public_id, deadline, record)
        self._calls[key] = call
        self._idle.clear()
        failure: BaseException | None = None
        try:
            yield call
        except BaseException as exc:
            failure = exc
            raise
        finally:
            # Shielded so a cancelled handler still aborts its engine requests.
            for gen in call.generators:
                await asyncio.shield(gen.aclose())
            del self._calls[key]
            self._finished[key] = None
            if len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)
            if not self._calls:
                self._idle.set()
            self._finish(record, failure, deadline)

    def _new_record(self, identity: Identity, public_id: str) -> RequestRecord:
        record = RequestRecord(public_id, identity.id)
        scope = current_scope()
        if scope is not None:
            scope.opened += 1  # this request is recorded here, not as a refused call
            record.method, record.operation, record.model = scope.method, scope.operation, scope.model
        return record

    def _finish(self, record: RequestRecord, failure: BaseException | None, deadline: float | None) -> None:
        passed = deadline is not None and asyncio.get_running_loop().time() >= deadline
        record.finish(failure, deadline_passed=passed)
        if record.prompt_tokens or record.output_tokens:
            self.usage.record(record.identity_id, record.prompt_tokens, record.output_tokens)
        if self.telemetry is not None:
            self.telemetry.request_finished(record)

    def generate(
        self, call: Call, engine: AsyncEngine, request: TokenizedRequest
    ) -> AsyncIterator[RequestOutput]:
        """Run ``request`` for ``call``: the engine's outputs, with deadline and usage handled."""
        gen = self._generate(call, engine, request)
        call.generators.append(gen)
        return gen

    async def _generate(
        self, call: Call, engine: AsyncEngine, request: TokenizedRequest
    ) -> AsyncIterator[RequestOutput]:
        reservation = None
        identity = call.identity
        weight = 1
        if self.limiter is not None:
            reservation = self.limiter.reserve_tokens(identity, reserved_tokens(request, engine.max_model_len))
            weight = self.limiter.limits(identity).weight
        request.tenant = Tenant(identity.id, identity.quota_id, weight)
        rid = request.request_id
        call.engine_requests[rid] = engine
        model = engine.model_name
        record, telemetry = call.record, self.telemetry
        record.served_model = model
        if telemetry is not None:
            request.trace = telemetry.request_trace(record)
        timer = None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            engine.abort(rid)

        if call.deadline is not None:
            timer = asyncio.get_running_loop().call_at(call.deadline, expire)
        prompt_tokens = 0
        generated = 0
        reasons: dict[int, FinishReason] = {}
        stats: RequestStats | None = None

        def abandoned(final: RequestOutput) -> None:
            # The caller left (hung up, cancelled) before the end: the abort's final output still
            # carries what the request did, for its log line and metrics.
            nonlocal stats
            reasons.update((d.index, d.finish_reason) for d in final.deltas if d.finish_reason)
            stats = final.stats

        try:
            async with contextlib.aclosing(engine.generate(request, on_abandoned=abandoned)) as outputs:
                if call.cancelled:
                    # Cancel arrived between opening the call and submitting this request.
                    engine.abort(rid)
                async for output in outputs:
                    new_prompt = 0 if prompt_tokens else output.num_prompt_tokens
                    prompt_tokens = output.num_prompt_tokens or prompt_tokens
                    new_tokens = sum(len(d.token_ids) for d in output.deltas)
                    generated += new_tokens
                    reasons.update((d.index, d.finish_reason) for d in output.deltas if d.finish_reason)
                    stats = output.stats or stats
                    if telemetry is not None:
                        telemetry.tokens(model, new_prompt, new_tokens)
                    if output.finished and expired:
                        # The timer, not the request, ended it. gRPC also fails the call at its deadline,
                        # but an answer sent first would reach a slow client as OK with cut-short text.
                        raise errors.deadline_exceeded()
                    yield output
                    if output.finished:
                        break
        finally:
            if timer is not None:
                timer.cancel()
            del call.engine_requests[rid]
            if self.limiter is not None:
                self.limiter.release(reservation, prompt_tokens + generated)
            record.add_engine_request(prompt_tokens, generated, [reasons[i] for i in sorted(reasons)], stats)
            if stats is not None and telemetry is not None:
                telemetry.engine_request_finished(model, stats)

    def cancel(self, identity: Identity, public_id: str) -> bool:
        """Cancel the caller's request; NOT_FOUND if the caller has no such request."""
        key = (identity.id, public_id)
        call = self._calls.get(key)
        if call is None:
            if key in self._finished:
                return False
            raise errors.request_not_found(public_id)
        return call.abort()

    def stop_accepting(self) -> None:
        """Refuse new calls (UNAVAILABLE) from now on."""
        self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every call to finish; True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_all(self) -> int:
        """Abort every running call (end of the grace period); returns how many."""
        calls = list(self._calls.values())
        for call in calls:
            call.abort()
        return len(calls)
