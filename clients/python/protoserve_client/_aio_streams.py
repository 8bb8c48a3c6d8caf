"""The clients' server-streaming calls: events converted as they arrive, cancellable.

Written once for asyncio; ``_sync_streams.py`` is generated from this file as
``client.py`` is from ``aio.py`` (see there). Edit this one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from protoserve_client._aio_io import (
    StreamCall,
    next_message,
)
from protoserve_client.agent_types import (
    AgentAnswer,
    AgentEvent,
    agent_event_from_proto,
)
from protoserve_client.rag_types import (
    RagCitations,
    RagDelta,
    RagFinal,
    RagStreamEvent,
    rag_stream_event_from_proto,
)
from protoserve_client.types import (
    StreamEvent,
    StreamFinal,
    stream_event_from_proto,
)

_Event = TypeVar("_Event")


class AsyncServerStream(Generic[_Event]):
    """Events of one server-streaming call, converted as they arrive; iterate it once.

    ``cancel()`` (or leaving its ``with`` block before the last event) abandons
    the call from this side; the server then stops the work as it does for any
    client that goes away, and iteration ends without an error.
    """

    def __init__(self, call: StreamCall, convert: Callable[[Any], _Event]) -> None:
        self._call = call
        self._convert = convert
        self._cancelled = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> _Event:
        msg = await next_message(self._call, lambda: self._cancelled)
        if msg is None:
            raise StopAsyncIteration
        event = self._convert(msg)
        self._seen(event)
        return event

    def _seen(self, event: _Event) -> None:
        """Record what later readers need (the final event); subclasses override."""

    def _ended(self) -> bool:
        """True once the call's last event has been read."""
        return False

    def cancel(self) -> None:
        """Hang up the call; iteration then stops without an error."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving early must not leave the server working for nobody.
        if not self._ended() and not self._call.done():
            self.cancel()


class AsyncGenerateStream(AsyncServerStream[StreamEvent]):
    """Events of one ``GenerateStream`` call: deltas, then one final; iterate it once.

    ``request_id`` is known before the first event, so another thread or task
    can pass it to the client's ``cancel``. ``cancel()`` (or leaving its
    ``with`` block early) abandons the call from this side instead; the server
    then stops the request as it does for any client that goes away.
    """

    def __init__(self, call: StreamCall, request_id: str) -> None:
        super().__init__(call, stream_event_from_proto)
        self.request_id = request_id
        self.final: StreamFinal | None = None

    def _seen(self, event: StreamEvent) -> None:
        if isinstance(event, StreamFinal):
            self.final = event

    def _ended(self) -> bool:
        return self.final is not None


class AsyncRagAnswerStream(AsyncServerStream[RagStreamEvent]):
    """Events of one ``RetrieveAndGenerateStream`` call: citations, text deltas, then one final.

    After iterating, ``citations`` and ``final`` hold those events and
    ``answer`` the text of every delta.
    """

    def __init__(self, call: StreamCall) -> None:
        super().__init__(call, rag_stream_event_from_proto)
        self.citations: RagCitations | None = None
        self.final: RagFinal | None = None
        self._text: list[str] = []

    @property
    def answer(self) -> str:
        """The answer text read so far."""
        return "".join(self._text)

    def _seen(self, event: RagStreamEvent) -> None:
        if isinstance(event, RagCitations):
            self.citations = event
        elif isinstance(event, RagDelta):
            self._text.append(event.text)
        else:
            self.final = event

    def _ended(self) -> bool:
        return self.final is not None


class AsyncAgentRun(AsyncServerStream[AgentEvent]):
    """Events of one ``RunAgent`` call: thoughts, tool calls and results, then one ``AgentAnswer``.

    ``run_id`` and ``answer`` are known once their events have been read.
    """

    def __init__(self, call: StreamCall) -> None:
        super().__init__(call, agent_event_from_proto)
        self.run_id = ""
        self.answer: AgentAnswer | None = None

    def _seen(self, event: AgentEvent) -> None:
        self.run_id = event.run_id
        if isinstance(event, AgentAnswer):
            self.answer = event

    def _ended(self) -> bool:
        return self.answer is not None
