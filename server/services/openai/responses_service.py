"""ResponsesService: the gRPC servicer of OpenAI's Responses API.

Creating a response is the ``responses.Responses`` surface; reading, listing the input items of and
deleting one are lookups in the caller's own partition of the response store, so an id that belongs
to another identity is NOT_FOUND, exactly as one that never existed.
"""

from __future__ import annotations

import asyncio

import grpc

from protoserve.openai.v1 import responses_pb2 as rs
from protoserve.openai.v1 import responses_pb2_grpc
from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.responses.store import ResponseStore
from protoserve.server.security.auth import Identity
from protoserve.server.services.openai.responses import Responses
from protoserve.server.services.openai.streaming import EngineRunner

DEFAULT_ITEMS_PAGE = 20
MAX_ITEMS_PAGE = 100


def _missing(response_id: str) -> errors.ServiceError:
    return errors.response_not_found(f"the caller has no stored response {errors.echo(response_id)}")


class ResponsesService(AdmittingServicer, responses_pb2_grpc.ResponsesServiceServicer):
    """OpenAI's Responses API over gRPC: create (unary and streamed), get, delete, input items."""

    def __init__(self, admission: Admission, *, store: ResponseStore | None) -> None:
        """``store`` None: the server keeps no responses (``store: true`` is refused)."""
        super().__init__(admission)
        self.responses = Responses(admission.models, EngineRunner(admission.inflight), store)

    @errors.reports_errors
    async def CreateResponse(
        self, request: rs.CreateResponseRequest, context: grpc.aio.ServicerContext
    ) -> rs.CreateResponseResponse:
        """Answer a conversation once, and keep the response unless ``store`` is false."""
        return await self.responses.create(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateResponseStream(
        self, request: rs.CreateResponseStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream a response's typed events."""
        await self.responses.create_stream(request, context, self._admit(context))

    def _owned(self, context: grpc.aio.ServicerContext, response_id: str) -> tuple[Identity, ResponseStore]:
        identity = self._admit(context)
        if not response_id:
            raise errors.invalid_argument([("response_id", "is required")])
        return identity, self.responses.stored_responses()

    @errors.reports_errors
    async def GetResponse(
        self, request: rs.GetResponseRequest, context: grpc.aio.ServicerContext
    ) -> rs.GetResponseResponse:
        """One of the caller's stored responses."""
        identity, store = self._owned(context, request.response_id)
        found = await asyncio.to_thread(store.get, identity.id, request.response_id)
        if found is None:
            raise _missing(request.response_id)
        return rs.GetResponseResponse(response=rs.Response.FromString(found.body))

    @errors.reports_errors
    async def DeleteResponse(
        self, request: rs.DeleteResponseRequest, context: grpc.aio.ServicerContext
    ) -> rs.DeleteResponseResponse:
        """Delete one of the caller's stored responses and its input items."""
        identity, store = self._owned(context, request.response_id)
        if not await asyncio.to_thread(store.delete, identity.id, request.response_id):
            raise _missing(request.response_id)
        return rs.DeleteResponseResponse(id=request.response_id, object="response.deleted", deleted=True)

    @errors.reports_errors
    async def ListInputItems(
        self, request: rs.ListInputItemsRequest, context: grpc.aio.ServicerContext
    ) -> rs.ListInputItemsResponse:
        """A page of the items a stored response was given (newest first unless ``order`` is asc)."""
        identity, store = self._owned(context, request.response_id)
        limit = request.limit if request.HasField("limit") else DEFAULT_ITEMS_PAGE
        violations = []
        if not 1 <= limit <= MAX_ITEMS_PAGE:
            violations.append(("limit", f"must be in [1, {MAX_ITEMS_PAGE}]"))
        order = request.order if request.HasField("order") else "desc"
        if order not in ("asc", "desc"):
            violations.append(("order", 'must be "asc" or "desc"'))
        if violations:
            raise errors.invalid_argument(violations)
        after = request.after if request.HasField("after") else None
        try:
            page = await asyncio.to_thread(
                store.input_items,
                identity.id,
                request.response_id,
                after=after,
                limit=limit,
                descending=order == "desc",
            )
        except LookupError:
            raise errors.invalid_argument(
                [("after", f"{errors.echo(after or '')} is no input item of this response")]
            ) from None
        if page is None:
            raise _missing(request.response_id)
        listing = rs.ListInputItemsResponse(
            object="list",
            data=[rs.ResponseItem.FromString(item.body) for item in page.items],
            has_more=page.has_more,
        )
        if page.items:
            listing.first_id, listing.last_id = page.items[0].id, page.items[-1].id
        return listing
